"""``localcluster/build-release.sh``: an earlier commit's tree, as the e2e upgrade test reads it (its image is built
by build-images.sh, which test_image_builds.py covers; the upgrade test installs it).

Each test extracts into its own releases dir (``RLJOB_RELEASES_DIR``), so the machine's cache is left alone.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rljob_localcluster import images

ROOT = Path(__file__).resolve().parents[2]


def _commit() -> str:
    """The commit the upgrade test starts from (tests/e2e/upgrade-from)."""
    text = (ROOT / "tests" / "e2e" / "upgrade-from").read_text()
    return next(ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#"))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def test_the_upgrade_commit_is_in_the_history_and_has_a_chart():
    sha = _git("rev-parse", "--verify", f"{_commit()}^{{commit}}").strip()
    assert len(sha) == 40
    assert "rltrainingjobs.rljob.dev.yaml" in _git("ls-tree", "--name-only", sha, "helm/rljob-operator/crds/")


def test_source_only_extracts_the_commit_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RLJOB_RELEASES_DIR", str(tmp_path))
    sha = _git("rev-parse", _commit()).strip()
    release = images.build_release(_commit(), source_only=True)
    assert release == tmp_path / sha[:12]
    assert (release / "src" / ".commit").read_text().strip() == sha
    chart = "helm/rljob-operator/crds/rltrainingjobs.rljob.dev.yaml"
    assert (release / "src" / chart).read_text() == _git("show", f"{sha}:{chart}")
    assert not (release / "images").exists()

    marker = release / "src" / "kept"  # a second run keeps the extracted tree (cached by commit)
    marker.write_text("")
    assert images.build_release(_commit(), source_only=True) == release and marker.exists()


def test_a_commit_outside_the_history_is_refused_by_name(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("RLJOB_RELEASES_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed with exit code 1"):
        images.build_release("0" * 40, source_only=True)
    assert f"commit '{'0' * 40}' is not in the history" in capfd.readouterr().err
    assert not any(tmp_path.iterdir())
