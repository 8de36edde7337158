"""Container logs: ``<state-dir>/logs/<namespace>_<pod>_<container>.log``.

Each file holds the raw stdout and stderr of one container of one pod (one pod UID), appended across
restarts of the container (kubelet's ``--previous`` is not served) and across agent restarts that take
the pod over again. ``kubectl logs`` reads the same files through the agent's log endpoint
(``kubeletapi.py``), as :func:`logs` does.

A new pod that reuses the name (a gang restart's ``job-trainer-0``) starts its log afresh: the earlier
pod's file moves to ``<state-dir>/logs/previous/<namespace>_<pod>_<container>.<uid>.log`` (``<uid>``: the
first 8 characters of that pod's UID; ``unknown-<mtime>`` when no owner was recorded), where neither
``kubectl logs`` nor :func:`logs` looks, but post-mortems can (sort by modification time for the order
of the attempts). The owner of each current file is recorded in ``logs/.owners/``. Everything stays until
the state dir is removed (``python -m rljob_localcluster down``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PREVIOUS_DIR", "STATE_DIR_ENV", "claim_log", "default_state_dir", "log_path", "logs"]

STATE_DIR_ENV = "RLJOB_AGENT_STATE_DIR"
PREVIOUS_DIR = "previous"
"""Sub-folder of ``logs/`` that holds the logs of earlier pods of the same name."""
OWNERS_DIR = ".owners"


def default_state_dir() -> Path:
    """``$RLJOB_AGENT_STATE_DIR``, else ``~/.cache/rljob/agent``."""
    env = os.environ.get(STATE_DIR_ENV)
    return Path(env) if env else Path.home() / ".cache" / "rljob" / "agent"


def log_path(state_dir: Path, namespace: str, pod: str, container: str) -> Path:
    """Where container ``container`` of pod ``namespace/pod`` writes its output."""
    return Path(state_dir) / "logs" / f"{namespace}_{pod}_{container}.log"


def claim_log(state_dir: Path, namespace: str, pod: str, container: str, uid: str) -> Path:
    """The log file of container ``container`` of pod ``namespace/pod`` with UID ``uid``, to append to.

    A file another pod of that name left (another UID, or no recorded owner) is first moved to
    ``logs/previous/`` (see the module doc), so the pod's log starts empty; the same pod's file (a container
    restart, or the pod taken over by a restarted agent) is kept.

    Raises:
        OSError: the logs folder cannot be written.
    """
    path = log_path(state_dir, namespace, pod, container)
    owner_file = path.parent / OWNERS_DIR / path.stem
    try:
        owner = owner_file.read_text().strip()
    except FileNotFoundError:
        owner = None
    if owner == uid:
        return path
    if path.exists():
        tag = owner[:8] if owner else f"unknown-{int(path.stat().st_mtime)}"
        previous = path.parent / PREVIOUS_DIR / f"{path.stem}.{tag}.log"
        previous.parent.mkdir(parents=True, exist_ok=True)
        path.rename(previous)
    owner_file.parent.mkdir(parents=True, exist_ok=True)
    owner_file.write_text(uid + "\n")
    return path


def logs(namespace: str, pod: str, container: str | None = None, state_dir: str | os.PathLike | None = None) -> str:
    """The log text of one container of a pod run by the local node agent (the latest pod of that name).

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
