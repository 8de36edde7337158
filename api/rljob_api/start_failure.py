"""How a trainer or rollout process says it cannot start, and how the operator reads it back (DESIGN §5 "Start
failures").

The entry points (``rljob_trainer.train``, ``rljob_rollout``) turn a :class:`StartFailure` into one line,
:meth:`StartFailure.line`, written to the container's termination message file (:data:`~rljob_api.constants.
TERMINATION_LOG`) and logged last, and exit with :data:`~rljob_api.constants.EXIT_START_FAILED` (permanent) or
:data:`~rljob_api.constants.EXIT_START_RETRY` (transient). The kubelet keeps the file in the pod's status
(``state.terminated.message``, or ``lastState`` once a rollout container restarted); the operator finds a permanent one
there (:func:`permanent`) and fails the job with reason StartFailed and the line's words, instead of restarting a gang
that cannot start (or letting a rollout container crash-loop while the trainer starves). The line, not the exit
code, is the contract: under torchrun a rank's exit code becomes torchrun's 1.

The message names the spec field and its value, e.g. ``spec.model.name: 'Qwen/Qwen2.5-0.5B-Instruct' is not in the
pod's Hugging Face cache (...) and HF_HUB_OFFLINE is set, so it cannot be downloaded: ...``.
"""

from __future__ import annotations

import os
from typing import Optional

from rljob_api import constants as c

PERMANENT = "cannot start (permanent, not retried): "
"""Starts the termination line of a failure retrying cannot fix."""
TRANSIENT = "cannot start (transient, retried): "
"""Starts the termination line of a failure that may pass (the pod is restarted like after any other failure)."""
MESSAGE_MAX = 1000
"""Characters of a failure's message kept in the termination line (the kubelet keeps 4096 bytes) and in conditions."""


class StartFailure(Exception):
    """A role cannot start: ``message`` names the spec field and its value and says what to do; ``permanent``: retrying
    cannot fix it (the config names something this image or cluster does not have)."""

    def __init__(self, message: str, permanent: bool = True):
        super().__init__(message)
        self.message = message
        self.permanent = permanent

    @property
    def line(self) -> str:
        """The termination line: :data:`PERMANENT` or :data:`TRANSIENT`, then the message on one line."""
        text = " ".join(self.message.split())
        if len(text) > MESSAGE_MAX:
            text = text[:MESSAGE_MAX - 1] + "…"
        return (PERMANENT if self.permanent else TRANSIENT) + text

    @property
    def exit_code(self) -> int:
        return c.EXIT_START_FAILED if self.permanent else c.EXIT_START_RETRY

    def report(self, path: Optional[str] = None) -> None:
        """Write :attr:`line` to the termination message file ``path`` (default: env
        :data:`~rljob_api.constants.ENV_TERMINATION_LOG`, else :data:`~rljob_api.constants.TERMINATION_LOG`) when it
        exists (the kubelet makes it; outside a pod there is none, and the logged line is all there is); a file that
        cannot be written is left as it is."""
        path = path or os.environ.get(c.ENV_TERMINATION_LOG) or c.TERMINATION_LOG
        if not os.path.exists(path):
            return
        try:
            with open(path, "w", encoding="utf-8") as file:
                file.write(self.line + "\n")
        except OSError:
            pass


def permanent(termination_message: str) -> Optional[str]:
    """The message of a permanent start failure when ``termination_message`` (a container's, as the pod status holds
    it) ends with its line (the file's content, or with FallbackToLogsOnError the log's last line, which may carry a
    log prefix before :data:`PERMANENT`); None otherwise."""
    lines = [line.strip() for line in termination_message.splitlines() if line.strip()]
    if not lines or PERMANENT not in lines[-1]:
        return None
    return lines[-1].split(PERMANENT, 1)[1][:MESSAGE_MAX] or None
