"""Fixtures of the local-cluster tests: the session's control plane and a fresh namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from conftest_cluster import control_plane  # noqa: F401 - the session's control plane fixture
from waiting import wait_until


@pytest.fixture
def namespace(control_plane) -> Iterator[str]:  # noqa: F811 - the imported fixture, injected by pytest
    """A new namespace ``t-<8 hex>``, deleted after the test (without waiting for it to go)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.kubectl("create", "namespace", name)
    yield name
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def pod_namespace(control_plane, namespace: str) -> str:  # noqa: F811
    """``namespace`` once its ``default`` ServiceAccount exists (the controller manager makes it; the API server
    refuses pods before that)."""
    wait_until(lambda: control_plane.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode == 0,
               30, f"the default ServiceAccount of {namespace}")
    return namespace
