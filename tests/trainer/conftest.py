"""Fixtures shared by the trainer tests."""

import pytest


@pytest.fixture()
def client(redis_server):
    """A client of the test's real Redis (``redis_server``), closed afterwards."""
    client = redis_server.client()
    yield client
    client.close()


@pytest.fixture()
def no_torchrun_env(monkeypatch):
    """No torchrun variables in this process's environment: an in-process ``run`` forms a world of one (modules that
    mix in-process runs with torchrun gangs use it for every test: ``pytestmark``)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
