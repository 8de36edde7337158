"""Serve an OpenEnv environment class over HTTP and WebSocket with OpenEnv's own server (``openenv-core``'s
``create_app``, uvicorn): rljob's toy environment from rljob's own image, or any class of the same shape.

    python -m rljob_rollout.environments.serve [--entrypoint module:Class] [--port 8000] [--host 0.0.0.0]
        [--max-sessions 256] [--arg high=99 ...]

The class (default :class:`rljob_rollout.environments.guess.GuessNumber`) is an OpenEnv ``Environment`` with
``action_type`` and ``observation_type`` class attributes (its Action and Observation classes); ``--arg name=value``
passes keyword arguments to it (integers as integers). Each WebSocket session gets an instance of its own, up to
``--max-sessions`` at once (set it to at least the rollout's episodes in flight, all workers together). OpenEnv serves
``/ws`` (the episodes), ``/reset``, ``/step``, ``/state``, ``/schema`` and ``/health`` (a readiness probe).
Exit codes: 0 after SIGTERM, 2 on a bad argument or class (one line naming it).

OpenEnv 0.3.0's WebSocket endpoint closes every session's socket when it ends, also one its client has already closed
(rljob's sessions end with OpenEnv's own ``close``), and uvicorn then logs an "Exception in ASGI application" with two
tracebacks for an episode that went well: :class:`ClosedByClient` drops exactly those records (thousands a minute with
the example's 512 episodes per step, and their formatting cost CPU the server shares).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from typing import Any, Optional, Sequence

DEFAULT_ENTRYPOINT = "rljob_rollout.environments.guess:GuessNumber"
DEFAULT_PORT = 8000
DEFAULT_MAX_SESSIONS = 256


class ClosedByClient(logging.Filter):
    """Drops uvicorn's error record of a WebSocket that OpenEnv's endpoint closed after its client had (module
    docstring): a ``WebSocketDisconnect`` raised while handling uvicorn's ``ClientDisconnected``. Every other record
    passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (type(error).__name__ == "WebSocketDisconnect"
                    and type(error.__context__).__name__ == "ClientDisconnected")


def _value(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        return text


def build_app(entrypoint: str = DEFAULT_ENTRYPOINT, max_sessions: int = DEFAULT_MAX_SESSIONS,
              arguments: Optional[dict[str, Any]] = None) -> Any:
    """The FastAPI app serving ``entrypoint``'s class.

    Raises:
        ValueError: the class cannot be loaded, lacks ``action_type`` / ``observation_type``, or refuses ``arguments``
            (names the option).
    """
    from openenv.core.env_server import create_app

    from rljob_rollout.environments.sessions import load_environment_class

    try:
        environment_class = load_environment_class(entrypoint)
    except ValueError as error:
        raise ValueError(f"--entrypoint: {str(error).partition(': ')[2]}") from None
    missing = [name for name in ("action_type", "observation_type") if getattr(environment_class, name, None) is None]
    if missing:
        raise ValueError(f"--entrypoint: {entrypoint} has no {' or '.join(missing)} attribute (its OpenEnv Action and "
                         "Observation classes)")
    factory = functools.partial(environment_class, **(arguments or {}))
    try:
        factory()  # a bad --arg fails here, once, not in every session
    except (TypeError, ValueError) as error:
        raise ValueError(f"--arg: {environment_class.__name__}({arguments or {}}) raised {error}") from None
    return create_app(factory, environment_class.action_type, environment_class.observation_type,
                      env_name=environment_class.__name__, max_concurrent_envs=max_sessions)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rljob_rollout.environments.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--entrypoint", default=DEFAULT_ENTRYPOINT, help="module:Class of the environment")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-sessions", type=int, default=DEFAULT_MAX_SESSIONS)
    parser.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                        help="keyword argument of the class (repeatable)")
    args = parser.parse_args(argv)
    arguments = {}
    for item in args.arg:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"--arg: {item!r} is not NAME=VALUE", file=sys.stderr)
            return 2
        arguments[name] = _value(value)
    try:
        app = build_app(args.entrypoint, args.max_sessions, arguments)
    except ValueError as error:
        print(f"cannot serve: {error}", file=sys.stderr)
        return 2
    import uvicorn

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")  # configures uvicorn's loggers
    logging.getLogger("uvicorn.error").addFilter(ClosedByClient())
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
