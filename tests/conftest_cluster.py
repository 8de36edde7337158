"""The local control-plane fixture, for conftests to import.

    # tests/conftest.py
    from conftest_cluster import control_plane  # noqa: F401
or
    pytest_plugins = ["rljob_localcluster.pytest_plugin"]

``control_plane`` is session-scoped and yields a started
``rljob_localcluster.ControlPlane`` (``.kubeconfig``, ``.server``, ``.kubectl(...)``, ``.env()``,
``.write_kubeconfig(path, user, groups)``); it skips only when RLJOB_SKIP_CLUSTER=1. However many
modules import it, one control plane serves the session.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from rljob_localcluster import ControlPlane  # noqa: F401
except ImportError:  # not installed (or installed before the package existed): use the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "localcluster"))
    for _name in [m for m in sys.modules if m.startswith("rljob_localcluster")]:
        del sys.modules[_name]

from rljob_localcluster.pytest_plugin import (  # noqa: F401
    acquire_control_plane,
    control_plane,
    release_control_plane,
)
