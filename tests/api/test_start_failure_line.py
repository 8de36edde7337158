"""The one line a process that cannot start leaves for the operator (rljob_api.start_failure): its words, its exit code,
its file, and how the operator finds a permanent one in a termination message."""

from __future__ import annotations

from rljob_api import constants as c
from rljob_api.start_failure import MESSAGE_MAX, StartFailure, permanent

MESSAGE = "spec.model.path: '/models/nope': no such directory in this container: mount the model there"


def test_the_line_says_permanent_or_transient_then_the_message_on_one_line():
    assert StartFailure(MESSAGE).line == "cannot start (permanent, not retried): " + MESSAGE
    assert StartFailure("spec.model.name: 'a/b': the Hub\ncannot be reached", permanent=False).line == (
        "cannot start (transient, retried): spec.model.name: 'a/b': the Hub cannot be reached")
    assert (StartFailure(MESSAGE).exit_code, StartFailure(MESSAGE, permanent=False).exit_code) == (78, 75)
    long = StartFailure("spec.model.name: " + "x" * 2000).line
    assert len(long) == len("cannot start (permanent, not retried): ") + MESSAGE_MAX and long.endswith("x…")


def test_the_line_goes_to_the_termination_message_file_when_there_is_one(tmp_path, monkeypatch):
    log = tmp_path / "termination-log"
    StartFailure(MESSAGE).report(str(log))
    assert not log.exists()  # outside a pod there is no file, and none is made
    log.write_text("")
    StartFailure(MESSAGE).report(str(log))
    assert log.read_text() == "cannot start (permanent, not retried): " + MESSAGE + "\n"
    other = tmp_path / "other-log"
    other.write_text("an earlier line\n")
    monkeypatch.setenv(c.ENV_TERMINATION_LOG, str(other))
    StartFailure(MESSAGE, permanent=False).report()
    assert other.read_text() == "cannot start (transient, retried): " + MESSAGE + "\n"


def test_the_operator_finds_a_permanent_line_at_the_end_of_a_termination_message():
    line = StartFailure(MESSAGE).line
    assert permanent(line + "\n") == MESSAGE
    assert permanent(f"2026-01-01 12:00:03,512 ERROR rljob_rollout: rollout: {line}\n\n") == MESSAGE  # a log's tail
    assert permanent(f"{line}\nTraceback (most recent call last):\nKeyError: 'x'\n") is None  # not the last line
    assert permanent(StartFailure(MESSAGE, permanent=False).line) is None
    assert permanent("rollout: cannot start: spec.rollout.task.datasetPath: no file at '/data/x.jsonl'") is None
    assert permanent("") is None
