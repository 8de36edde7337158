"""Where the pinned helm binary is (built by localcluster/build-go-tools.sh) and how to render the chart."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional

import yaml
from rljob_localcluster.tools import pinned_versions

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "rljob-operator"


def helm_binary() -> Optional[Path]:
    """The pinned helm from the tools cache, or None when it has not been built on this machine."""
    override = os.environ.get("RLJOB_TOOLS_BIN_DIR")
    if override:
        return Path(override) / "helm" if (Path(override) / "helm").exists() else None
    version = pinned_versions()["helm"]
    cache = Path(os.environ.get("RLJOB_TOOLS_DIR", Path.home() / ".cache" / "rljob" / "tools"))
    path = cache / f"helm-{version}" / "helm"
    return path if path.exists() else None


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    binary = helm_binary()
    if binary is None:
        raise FileNotFoundError("helm is not built; run localcluster/build-go-tools.sh helm")
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/rljob-helm/cache", "HELM_CONFIG_HOME": "/tmp/rljob-helm/config",
           "HELM_DATA_HOME": "/tmp/rljob-helm/data"}
    return subprocess.run([str(binary), *args], capture_output=True, text=True, check=check, env=env, timeout=120)


def render(*sets: str, release: str = "rel", namespace: str = "rljob-system") -> list[dict]:
    """``helm template`` with ``--set`` values; the rendered objects (CRDs not included)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    for value in sets:
        args += ["--set", value]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]
