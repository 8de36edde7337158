"""Fixtures shared by every test: a real Redis server (Debian's redis-server) on a free loopback port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from portutil import free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class RedisServer:
    """A redis-server process this test session started (stopped by pid, also on failure)."""

    host: str
    port: int
    password: str
    process: subprocess.Popen
    data_dir: Path

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs):
        import redis

        return redis.Redis(host=self.host, port=self.port, password=self.password, **kwargs)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def start(self) -> None:
        """(Re)start the server on the same port and data dir (for restart-recovery tests)."""
        self.process = _spawn_redis(self.port, self.password, self.data_dir)


def _spawn_redis(port: int, password: str, data_dir: Path) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; .ci/run does this)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password, "--dir", str(data_dir),
         "--save", "", "--appendonly", "yes", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"redis-server exited with {proc.returncode}")
            time.sleep(0.05)
    proc.kill()
    pytest.fail("redis-server did not start within 20 s")


@pytest.fixture()
def redis_server() -> Iterator[RedisServer]:
    """A fresh Redis with a password, per test; its append-only file survives :meth:`RedisServer.stop`."""
    data_dir = Path(tempfile.mkdtemp(prefix="rljob-redis-"))
    port = free_port()
    server = RedisServer("127.0.0.1", port, "test-password", _spawn_redis(port, "test-password", data_dir), data_dir)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
