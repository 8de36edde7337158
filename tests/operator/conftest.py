"""Fixtures of the operator tests: an owner body, and the local control plane (cluster tests only)."""

from __future__ import annotations

import pytest

from conftest_cluster import control_plane  # noqa: F401  (the session's local control plane)


@pytest.fixture()
def owner() -> dict:
    """An RLTrainingJob body as the API server returns it (what children are adopted by)."""
    return {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "demo", "namespace": "ns", "uid": "0f7a-uid", "generation": 1, "resourceVersion": "7"},
    }
