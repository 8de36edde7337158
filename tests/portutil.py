"""Free-port lookup shared by the test helpers (a module with a unique name: every test folder has its own
``conftest``, so ``from conftest import ...`` would depend on which one was imported first)."""

import socket


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
