"""Locating (and if needed building) the Go tools: kube-*, kubectl, kubelet, etcd, helm, coredns, kueue.

All of them come from ``localcluster/build-go-tools.sh``, which caches binaries outside the
repository keyed by version and prints a bin dir of symlinks for the pinned set. With the cache
present that script returns in well under a second, so calling it is the way to find the bin dir.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import cache
from pathlib import Path

#: Binaries the bin dir holds (kubelet, kube-proxy and coredns run the local nodes; kueue is Kueue's manager,
#: :mod:`rljob_localcluster.kueue`).
TOOLS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm", "kubelet",
         "kube-proxy", "coredns", "kueue")

_LOCALCLUSTER_DIR = Path(__file__).resolve().parent.parent


def script(name: str) -> Path:
    """Path of ``localcluster/<name>`` (a build script: build-go-tools.sh, build-images.sh); RLJOB_REPO_ROOT
    overrides the repository it is looked up in."""
    root = os.environ.get("RLJOB_REPO_ROOT")
    return (Path(root) / "localcluster" if root else _LOCALCLUSTER_DIR) / name


def pinned_versions() -> dict[str, str]:
    """{"kubernetes": "v1.34.4", "etcd": "v3.6.16", "helm": "v3.19.5", "coredns": "v1.14.1", "kueue": "v0.17.0"}
    as pinned in gotools/."""
    out = subprocess.run(
        ["bash", str(script("build-go-tools.sh")), "--versions"], check=True, capture_output=True, text=True
    ).stdout
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def run_build_script(cmd: list[str], env: dict[str, str], what: str) -> Path:
    """Run one of localcluster's build scripts (``bash cmd...`` with ``env`` added; its progress goes to this
    process's stderr) and return the path it prints on its last stdout line (``what``: the bin dir, the index).

    Raises:
        RuntimeError: the script failed or printed nothing.
    """
    cmd = ["bash", *cmd]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, check=False,
                          env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"{' '.join(cmd)} printed no {what}")
    return Path(lines[-1].strip())


@cache
def tools_bin_dir() -> Path:
    """Directory holding every tool of the pinned set.

    ``RLJOB_TOOLS_BIN_DIR`` overrides it (a dir with the same binaries). Otherwise runs
    ``build-go-tools.sh``, which builds whatever is missing (tens of minutes cold; its progress
    goes to this process's stderr) and prints the bin dir.
    """
    override = os.environ.get("RLJOB_TOOLS_BIN_DIR")
    if override:
        d = Path(override)
        missing = [t for t in TOOLS if not (d / t).exists()]
        if missing:
            raise FileNotFoundError(f"RLJOB_TOOLS_BIN_DIR={d} lacks {', '.join(missing)}")
        return d
    path = script("build-go-tools.sh")
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; set RLJOB_TOOLS_BIN_DIR or RLJOB_REPO_ROOT")
    # The cached-tools lines are setup.sh's to print.
    d = run_build_script([str(path)], {"RLJOB_TOOLS_QUIET": "1"}, "bin dir")
    missing = [t for t in TOOLS if not (d / t).exists()]
    if missing:
        raise RuntimeError(f"bin dir {d} lacks {', '.join(missing)}")
    return d


def tool(name: str) -> str:
    """Absolute path of one tool from the bin dir."""
    if name not in TOOLS:
        raise KeyError(f"unknown tool {name!r}; known: {', '.join(TOOLS)}")
    return str(tools_bin_dir() / name)
