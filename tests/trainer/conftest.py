"""Fixtures shared by the trainer tests."""

import pytest


@pytest.fixture()
def client(redis_server):
    """A client of the test's real Redis (``redis_server``), closed afterwards."""
    client = redis_server.client()
    yield client
    client.close()
