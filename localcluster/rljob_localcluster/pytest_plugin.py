"""pytest fixtures for the local control plane.

Register in a root conftest with ``pytest_plugins = ["rljob_localcluster.pytest_plugin"]`` (or
import ``control_plane`` from ``tests/conftest_cluster.py``). One control plane is shared by the
whole test session however many modules register the fixture; it is stopped when the last user's
session fixture finalises (and at interpreter exit at the latest).

Set ``RLJOB_SKIP_CLUSTER=1`` to skip every test that needs it. Building the tools when they are
not cached takes tens of minutes (``localcluster/build-go-tools.sh``); anything else that goes wrong
is an error, never a skip.
"""

from __future__ import annotations

import os
import threading

import pytest

from .controlplane import ControlPlane

_lock = threading.Lock()
_shared: ControlPlane | None = None
_users = 0


def _options() -> dict:
    """The shared control plane can take real nodes (rljob_localcluster.nodes.LocalNodes): it listens on every
    address, advertises the host's default-route address and has the short node timings. Without a default
    route it stays on loopback (nodes cannot start then)."""
    from .nodes import node_control_plane_options

    try:
        return node_control_plane_options()
    except (RuntimeError, OSError):
        return {}


def acquire_control_plane() -> ControlPlane:
    """Start (once) and return the shared control plane; pair with release_control_plane()."""
    global _shared, _users
    with _lock:
        if _shared is None:
            cp = ControlPlane(**_options())
            cp.start()
            _shared = cp
        _users += 1
        return _shared


def release_control_plane() -> None:
    global _shared, _users
    with _lock:
        _users -= 1
        if _users <= 0 and _shared is not None:
            _shared.stop()
            _shared = None
            _users = 0


@pytest.fixture(scope="session")
def control_plane():
    """A running ControlPlane (``.kubeconfig``, ``.server``, ``.kubectl(...)``, ``.env()``)."""
    if os.environ.get("RLJOB_SKIP_CLUSTER") == "1":
        pytest.skip("RLJOB_SKIP_CLUSTER=1")
    cp = acquire_control_plane()
    try:
        yield cp
    finally:
        release_control_plane()
