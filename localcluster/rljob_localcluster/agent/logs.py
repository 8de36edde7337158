"""Container logs: ``<state-dir>/logs/<namespace>_<pod>_<container>.log``.

Each file holds the container's raw stdout and stderr, appended across restarts of the container
and across pods that reuse the name. ``kubectl logs`` reads the same files through the agent's
log endpoint (``kubeletapi.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["STATE_DIR_ENV", "default_state_dir", "log_path", "logs"]

STATE_DIR_ENV = "RLJOB_AGENT_STATE_DIR"


def default_state_dir() -> Path:
    """``$RLJOB_AGENT_STATE_DIR``, else ``~/.cache/rljob/agent``."""
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "rljob" / "agent"


def log_path(state_dir: Path, namespace: str, pod: str, container: str) -> Path:
    """Where container ``container`` of pod ``namespace/pod`` writes its output."""
    return Path(state_dir) / "logs" / f"{namespace}_{pod}_{container}.log"


def logs(namespace: str, pod: str, container: str | None = None, state_dir: str | os.PathLike | None = None) -> str:
    """The log text of one container of a pod run by the local node agent.

    Args:
        namespace, pod: the pod.
        container: needed only when the pod has several containers with logs.
        state_dir: the agent's ``--state-dir`` (default: :func:`default_state_dir`).

    Raises:
        FileNotFoundError: no log for that pod (or container) exists.
        ValueError: ``container`` is None and the pod has logs of several containers.
    """
    root = Path(state_dir) if state_dir is not None else default_state_dir()
    if container is not None:
        path = log_path(root, namespace, pod, container)
        if not path.exists():
            raise FileNotFoundError(f"no log for container {container!r} of pod {namespace}/{pod} in {root / 'logs'}")
        return path.read_text(errors="replace")
    prefix = f"{namespace}_{pod}_"
    found = sorted(p for p in (root / "logs").glob(f"{prefix}*.log") if "_" not in p.name[len(prefix):-4])
    if not found:
        raise FileNotFoundError(f"no logs for pod {namespace}/{pod} in {root / 'logs'}")
    if len(found) > 1:
        names = [p.name[len(prefix):-4] for p in found]
        raise ValueError(f"pod {namespace}/{pod} has logs of several containers {names}; pass container=")
    return found[0].read_text(errors="replace")
