"""Process lookup shared by the node-agent tests."""

from pathlib import Path


def pids_with_env_marker(marker: str) -> list[int]:
    """Pids of live processes whose environment contains ``marker`` (reads /proc/<pid>/environ)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found
