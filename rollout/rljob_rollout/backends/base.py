"""The one interface both generation backends (``cpu``, ``vllm``) implement.

Log-probability convention (DESIGN §2 "Token alignment"): a completion's ``logprobs[i]`` is
``log softmax(logits / temperature)[token_ids[i]]`` over the FULL vocabulary, given the prompt and
``token_ids[:i]`` — the quantity :func:`rljob_wire.model.sequence_logprobs` recomputes on the trainer, which
knows the temperature but not top-p. Sampling itself draws from the top-p nucleus of that distribution, so with
``topP < 1`` the behaviour policy is the truncated distribution while both old and new log-probabilities are
of the untruncated one; the importance ratio then stays consistent between old and new, at the price of a small
off-policy bias on the truncated tail (none with ``topP = 1``, the usual RL setting).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch

from rljob_api.spec import SamplingSpec
from rljob_api.protocol import TransferTicket
from rljob_wire.transfer import StoreAddress

if TYPE_CHECKING:
    from rljob_rollout.tasks import Prompt


@dataclass(frozen=True)
class Completion:
    """One sampled completion (prompt excluded).

    Attributes:
        token_ids: [N] generated token ids, N <= max new tokens, the stop token included when one was sampled.
        logprobs: [N] float, log-probability of each generated token at the sampling temperature (see the module
            docstring), natural log.
        finish_reason: ``"stop"`` (end-of-sequence sampled) or ``"length"`` (hit the token limit).
        versions: [N] the weights version (documents) that sampled each token, with every token before it computed
            by those weights too (DESIGN §3 "In-flight weight updates"); None from a backend whose weights change only
            between generations: every token then has the version the group was submitted under.
        masked_spans: half-open ``(begin, end)`` ranges of ``token_ids`` the model did not sample (an environment's
            observations in an episode, :mod:`rljob_rollout.environments.episodes`): their log-probabilities are 0
            and their labels masked in the document. Empty for a backend's own completions.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    versions: Optional[tuple[int, ...]] = None
    masked_spans: tuple[tuple[int, int], ...] = ()


Group = Optional[list[Completion]]
"""A finished group: its completions in order, or None when the backend aborted it (a torn weight update)."""


class UpdateOutcome(enum.Enum):
    """What a weight update did to a backend's weights."""

    LOADED = "loaded"
    """Every tensor arrived and was loaded: the weights are the event's version."""
    NOT_SELECTED = "not_selected"
    """The trainer formed the group without this worker (too late to join): weights unchanged."""
    FAILED_INTACT = "failed_intact"
    """The transfer failed before anything was loaded: the old weights (and version) are still valid."""
    FAILED_TORN = "failed_torn"
    """The transfer failed after some tensors were loaded: the weights match no version; generate nothing
    until the next successful update."""


class GenerationBackend(ABC):
    """Generates completions with per-token log-probabilities and takes new weights from the trainer.

    Groups go in with :meth:`submit` and come out with :meth:`finished`. This base class runs what was submitted as
    one :meth:`generate` call inside :meth:`finished`, so its weights change only between those calls
    (``continuous = False``); a backend with an engine of its own (``vllm``) runs groups while the worker goes on and
    takes weight updates while they are in flight (``continuous = True``).
    """

    continuous = False
    """Whether groups run while the worker goes on (and weight updates arrive while they are in flight)."""

    def __init__(self) -> None:
        self._submitted: list[tuple[int, Sequence[int], int, SamplingSpec]] = []

    @property
    def in_flight(self) -> int:
        """Groups submitted and not yet returned by :meth:`finished`."""
        return len(self._submitted)

    def submit(self, key: int, prompt_token_ids: Sequence[int], n: int, sampling: SamplingSpec) -> None:
        """Start sampling ``n`` completions of one prompt; :meth:`finished` returns them under ``key``."""
        self._submitted.append((key, prompt_token_ids, n, sampling))

    def submit_prompt(self, key: int, prompt: "Prompt", n: int, sampling: SamplingSpec) -> None:
        """:meth:`submit` of a task's prompt (its token ids): what the worker calls, so that an episode runner
        (:class:`~rljob_rollout.environments.episodes.EpisodeRunner`), which reads the prompt's seed, stands in for a
        backend."""
        self.submit(key, prompt.token_ids, n, sampling)

    def finished(self, timeout_s: float) -> list[tuple[int, Group]]:
        """Groups that finished (``(key, completions)``), waiting up to ``timeout_s`` seconds for the first one.
        Here: everything submitted, generated now in one :meth:`generate` per sampling setting."""
        submitted, self._submitted = self._submitted, []
        done: list[tuple[int, Group]] = []
        while submitted:
            n, sampling = submitted[0][2], submitted[0][3]
            same = [item for item in submitted if item[2] == n and item[3] == sampling]
            submitted = [item for item in submitted if not (item[2] == n and item[3] == sampling)]
            groups = self.generate([prompt for _, prompt, _, _ in same], n, sampling)
            done.extend((key, group) for (key, _, _, _), group in zip(same, groups))
        return done

    @abstractmethod
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingSpec) -> list[list[Completion]]:
        """Sample ``n`` completions for each prompt.

        Args:
            prompt_token_ids: P prompts, each a list of token ids (special tokens included).
            n: completions per prompt (the group size G).
            sampling: temperature, top-p and ``max_new_tokens`` (tokens per completion, at most).

        Returns:
            P lists of ``n`` :class:`Completion`, in prompt order.
        """

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights with ``named_tensors`` (Hugging Face parameter names, full tensors).

        Raises:
            ValueError: unknown or missing parameter names, or a shape mismatch (names them).
        """

    @abstractmethod
    def receive_weights(self, ticket: TransferTicket, address: StoreAddress, transfer_ranks: Sequence[int],
                        version: Optional[int] = None) -> UpdateOutcome:
        """Join the weight transfer of ``ticket`` as ``transfer_ranks`` (one per GPU process of this pod) and
        load what arrives, the weights of ``version`` (documents; None: not known, as in tools). Never raises for a failed transfer: the outcome
        says whether the old weights survived. A continuous backend keeps the groups in flight across a loaded or
        intact outcome and aborts them on a torn one (:meth:`finished` returns them as None)."""

    def close(self) -> None:
        """Release the engine (default: nothing to release)."""
