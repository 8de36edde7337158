"""Fencing of the trainer's Redis writes by gang attempt (DESIGN §6 "Fencing").

The operator stamps each trainer pod with its gang attempt (env ``RLJOB_ATTEMPT``) and the RLTrainingJob's uid (env
``RLJOB_JOB_UID``). At every start global rank 0 claims the job's keys for its owner ``<uid>:<attempt>`` in the key
``{prefix}attempt`` (:func:`claim`), before it reads a checkpoint: a later attempt of the same job object, or any
attempt of a new object of the same name (a job deleted and created again on a shared Redis keeps its keys), takes
over; an earlier attempt of the same object is refused. After that, the writes that decide what was trained — the checkpoint record, XACK, the trim, the progress hash and the
weights_ready/training_finished events — go through :func:`write`: one Lua script that compares the key with the
writer's attempt and runs the commands only when they are equal, atomically (Redis runs a script alone). A process of
an earlier attempt that is still alive (a partitioned node, a slow teardown, a force-deleted pod whose container
still runs) gets :class:`Fenced` and stops: it can no longer ack, commit, publish or report.

Outside the operator (no ``RLJOB_ATTEMPT``: tests, a manual torchrun) nothing is claimed and the same script runs
the commands unguarded. Either way a failing command ends the script: the commands after it do not run (a MULTI/EXEC
would run them: an XACK after a failed dead-letter XADD would lose the entry).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import redis

from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.config import RedisKeys

Command = Sequence[Any]
"""One Redis command with its arguments, e.g. ``("XACK", stream, group, "1-0")``."""

# ARGV: the job uid, the attempt. Replies {1 taken | 0 refused, the owner before or false}.
_CLAIM = """
local current = redis.call('GET', KEYS[1])
if current then
  local uid, attempt = string.match(current, '^(.*):(%d+)$')
  if uid == ARGV[1] and tonumber(attempt) > tonumber(ARGV[2]) then return {0, current} end
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2])
return {1, current}
"""
# ARGV: the owner '<uid>:<attempt>' ('' runs unguarded), then each command as its argument count followed by its arguments. A failing
# command ends the script there (those after it do not run), as sequential calls would.
_GUARDED = """
if ARGV[1] ~= '' then
  local current = redis.call('GET', KEYS[1])
  if current ~= ARGV[1] then return redis.error_reply('FENCED ' .. (current or 'none')) end
end
local results, i = {}, 2
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  results[#results + 1] = redis.call(unpack(ARGV, i + 1, i + n))
  i = i + n + 1
end
return results
"""


def gang_attempt() -> Optional[int]:
    """The gang attempt the operator stamped on this pod (env ``RLJOB_ATTEMPT``, status.attempt), or None outside the
    operator (tests, a manual torchrun) or when the value is not an integer."""
    try:
        return int(os.environ[c.ENV_ATTEMPT])
    except (KeyError, ValueError):
        return None


def job_uid() -> str:
    """The RLTrainingJob's uid the operator stamped on this pod (env ``RLJOB_JOB_UID``; "" when absent)."""
    return os.environ.get(c.ENV_JOB_UID, "")


def attempt_key(keys: RedisKeys) -> str:
    """The key holding the owner of the job's writes, ``<job uid>:<gang attempt>``: ``{prefix}attempt``."""
    return keys.prefix + protocol.KEY_ATTEMPT


class Fenced(RuntimeError):
    """A write of gang attempt ``attempt`` refused because ``owner`` (``<job uid>:<attempt>`` as Redis holds it) owns
    the job's keys (None: nobody, e.g. Redis lost its data). Not a redis.RedisError, so that no retry or
    log-and-skip path swallows it: the process stops."""

    def __init__(self, attempt: int, owner: Optional[str], uid: str = "") -> None:
        self.attempt, self.owner = attempt, owner
        self.current = _attempt_of(owner) if owner is not None and owner.rpartition(":")[0] == uid else None
        if owner is None:
            holder = "no attempt owns the job in Redis (did Redis lose its data?)"
        elif self.current is not None:
            holder = f"attempt {self.current} owns the job"
        else:
            holder = f"another RLTrainingJob of this name owns its keys ({owner})"
        super().__init__(f"fenced: this process belongs to gang attempt {attempt}, but {holder}; it stops writing "
                         "(DESIGN §6)")


def _attempt_of(owner: str) -> Optional[int]:
    try:
        return int(owner.rpartition(":")[2])
    except ValueError:
        return None


def claim(client: redis.Redis, keys: RedisKeys, attempt: Optional[int] = None, uid: Optional[str] = None) -> Optional[str]:
    """Make ``<uid>:<attempt>`` (default: this pod's, :func:`job_uid` and :func:`gang_attempt`) the owner of the job's
    writes; global rank 0 at every start, before it reads a checkpoint. Returns the owner before (None: none, or
    nothing claimed outside the operator).

    Raises:
        Fenced: a later attempt of the same job object owns the keys (this process is a leftover).
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    attempt, uid = gang_or(attempt), job_uid() if uid is None else uid
    if attempt is None:
        return None
    took, before = client.eval(_CLAIM, 1, attempt_key(keys), uid, attempt)
    before = None if before is None else protocol.text(before)
    if not took:
        raise Fenced(attempt, before, uid)
    return before


def check(client: redis.Redis, keys: RedisKeys, attempt: Optional[int] = None) -> None:
    """Raise :class:`Fenced` unless ``attempt`` (default: this pod's) of this job object owns the job; for a write Redis cannot guard,
    such as a commit file on the checkpoint volume (not atomic with it: the owner may change right after).

    Raises:
        Fenced: another attempt owns the job, or none does.
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    write(client, keys, [("GET", attempt_key(keys))], attempt)


def write(client: redis.Redis, keys: RedisKeys, commands: Sequence[Command],
          attempt: Optional[int] = None) -> list[Any]:
    """Run ``commands`` atomically (one script) if ``attempt`` (default: this pod's) of this job object owns the job, or
    unguarded without one (outside the operator); return their replies in order (status replies as bytes, b"OK").

    Raises:
        Fenced: another attempt owns the job, or none does (nothing ran).
        redis.ResponseError: a command failed (those before it ran, those after it did not; no rollback).
        redis.RedisError: Redis unreachable beyond the client's retries.
    """
    if not commands:
        return []
    with client.pipeline(transaction=True) as pipe:
        queue(pipe, keys, commands, attempt)
        return execute(pipe, attempt)[0]


def queue(pipe: redis.client.Pipeline, keys: RedisKeys, commands: Sequence[Command],
          attempt: Optional[int] = None) -> None:
    """Queue ``commands`` on a MULTI/EXEC pipeline (e.g. inside :meth:`redis.Redis.transaction`) as one script, guarded
    by ``attempt`` (default: this pod's; none: unguarded), whose one reply is the list of theirs; run it with
    :func:`execute`."""
    attempt = gang_or(attempt)
    argv: list[Any] = ["" if attempt is None else f"{job_uid()}:{attempt}"]
    for command in commands:
        argv += [len(command), *command]
    pipe.eval(_GUARDED, 1, attempt_key(keys), *argv)


def execute(pipe: redis.client.Pipeline, attempt: Optional[int] = None) -> list[Any]:
    """``pipe.execute()``, a refusal of :func:`queue`'s script raised as :class:`Fenced`.

    Raises:
        Fenced: another attempt owns the job, or none does.
        redis.RedisError: as ``pipe.execute()``.
    """
    try:
        return pipe.execute()
    except redis.ResponseError as err:
        raise refusal(err, attempt) from None


def refusal(error: redis.ResponseError, attempt: Optional[int] = None) -> Exception:
    """The :class:`Fenced` of a refusal of the guarded script (``FENCED <owner>``; ``FENCED none``: no owner), or
    ``error`` itself when it is another error (for ``raise refusal(err) from None`` in an ``except``)."""
    message = str(error)
    if "FENCED " not in message:
        return error
    owner = message.rsplit("FENCED ", 1)[1].split()[0]
    return Fenced(gang_or(attempt), None if owner == "none" else owner, job_uid())


def flat(mapping: Mapping[Any, Any]) -> list[Any]:
    """A mapping as the field, value, field, value ... arguments of HSET or XADD."""
    return [item for pair in mapping.items() for item in pair]


def gang_or(attempt: Optional[int]) -> Optional[int]:
    """``attempt``, or this pod's (:func:`gang_attempt`) when None."""
    return gang_attempt() if attempt is None else attempt
