"""An OpenEnv server in a process of its own (``python -m rljob_rollout.environments.serve``), for the rollout tests
that run episodes against one (the ``cpu`` backend's, tests/rollout/test_environments.py, and the real vLLM engine's,
tests/rollout/test_vllm_engine.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Iterator

from portutil import free_port
from waiting import wait_until

HERE = Path(__file__).parent
GUESS = "rljob_rollout.environments.guess:GuessNumber"
"""rljob's toy environment, guess-the-number."""


@contextlib.contextmanager
def served(entrypoint: str = GUESS, output: list[str] | None = None) -> Iterator[str]:
    """An OpenEnv server of ``entrypoint`` (``python -m rljob_rollout.environments.serve``) on a free port; yields its
    base URL once /health answers; killed on exit, also when the test fails; its stdout and stderr are appended to
    ``output`` then."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "rljob_rollout.environments.serve", "--entrypoint", entrypoint,
                                "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            return urllib.request.urlopen(f"{url}/health", timeout=1).status == 200
        except OSError:
            return False

    try:
        wait_until(healthy, 60, f"the environment server {entrypoint}")
        yield url
    finally:
        process.kill()
        process.wait(timeout=10)
        if output is not None:
            output.append(process.stdout.read().decode())
