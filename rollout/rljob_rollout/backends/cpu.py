"""The ``cpu`` backend: Hugging Face transformers ``generate`` in the worker's own process.

For tests, laptops and the toy task. Sampling uses an explicit ``GenerationConfig`` (so a checkpoint's own
generation defaults — top-k, repetition penalty — never sneak in): multinomial sampling at ``temperature``
within the ``top_p`` nucleus, no top-k. Log-probabilities come from the raw logits ``generate`` returns
(``output_logits``), as ``log_softmax(logits / temperature)`` gathered at the sampled tokens — the untruncated
distribution that :func:`rljob_wire.model.sequence_logprobs` recomputes (see :mod:`.base`).

Weight updates are staged: every tensor of an update is received into host memory first and loaded only when
the whole update has arrived and matches the model's parameters, so a failed transfer leaves the old weights
(and their version) intact. The staging buffers are kept from one update to the next (a packed update's buckets,
:class:`~rljob_wire.packed.BucketBuffers` ``whole``, its tensors read in place; a per-tensor update's
:class:`~rljob_wire.transfer.ReceiveBuffers`): a second copy of the published weights held for good, in exchange for
no fresh memory (and its page faults) per update. So is the transfer group, while the trainer keeps
it too (:class:`~rljob_wire.transfer.GroupKeeper`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from rljob_api.config import JobConfig
from rljob_api.spec import SamplingSpec
from rljob_wire.model import build_model
from rljob_rollout.backends.base import Completion, GenerationBackend, UpdateOutcome
from rljob_api.protocol import TransferTicket
from rljob_wire.packed import BucketBuffers
from rljob_wire.transfer import GroupKeeper, ReceiveBuffers, StoreAddress, TransferFailed, receive_update

log = logging.getLogger(__name__)


class CpuBackend(GenerationBackend):
    """transformers ``generate`` on a model held in this process.

    Args:
        model: a causal LM (``build_model``), put in eval mode.
        pad_token_id: id used to left-pad prompts of different lengths.
        eos_token_id: a completion stops after sampling it (None: only the length limit stops).
        max_rows: largest generate() batch (prompts × samples); bigger requests are split.
        device: where the model runs (``cpu``; a CUDA device works too, without vLLM's speed).

    Attributes:
        staging: the buffers per-tensor weight updates are received into (on CPU, in the sent dtype), kept between
            updates; ``buckets`` those of packed updates.
        groups: the transfer group kept between updates.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int | None,
        max_rows: int = 512,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.max_rows = max_rows
        self.staging = ReceiveBuffers()
        self.buckets = BucketBuffers(whole=True)  # a packed update's buckets, its tensors read in place
        self.groups = GroupKeeper()
        self.max_positions: Optional[int] = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        """The longest sequence the model runs (tokens), from its config; None when it has none."""

    @classmethod
    def from_config(cls, config: JobConfig, tokenizer: Any, seed: int) -> "CpuBackend":
        """The job's model (``build_model``; random for ``tiny`` until the first update) and a seeded sampler."""
        torch.manual_seed(seed)
        vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size  # as the trainer
        model = build_model(config.spec.model, vocab_size, seed=config.spec.trainer.seed)
        return cls(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], n: int, sampling: SamplingSpec) -> list[list[Completion]]:
        rows = [list(ids) for ids in prompt_token_ids for _ in range(n)]
        completions: list[Completion] = []
        for start in range(0, len(rows), self.max_rows):
            completions.extend(self._generate_rows(rows[start : start + self.max_rows], sampling))
        return [completions[p * n : (p + 1) * n] for p in range(len(prompt_token_ids))]

    def _generate_rows(self, rows: list[list[int]], sampling: SamplingSpec) -> list[Completion]:
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for row, ids in enumerate(rows):  # left padding: every row's next token is at the same column
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.int64)
            attention_mask[row, width - len(ids) :] = 1
        config = GenerationConfig(
            do_sample=True,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0,
            repetition_penalty=1.0,
            num_beams=1,
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), generation_config=config
        )
        generated = out.sequences[:, width:].cpu()  # [B, N]
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, N, V] raw, before any warper
        logprobs = F.log_softmax(logits / sampling.temperature, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        result = []
        for row in range(len(rows)):
            tokens = generated[row].tolist()
            finish = "length"
            if self.eos_token_id is not None and self.eos_token_id in tokens:
                tokens = tokens[: tokens.index(self.eos_token_id) + 1]
                finish = "stop"
            result.append(Completion(tuple(tokens), tuple(logprobs[row, : len(tokens)].tolist()), finish))
        return result

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``named_tensors`` into the model, or change nothing: every parameter must be there (buffers may),
        no unknown name, same shapes; dtypes are cast.

        Raises:
            ValueError: names missing from or unknown to the model, or a shape mismatch (lists them).
        """
        targets = self.model.state_dict(keep_vars=True)  # parameters (tied ones under every name) and buffers
        incoming = dict(named_tensors)
        missing = sorted({name for name, _ in self.model.named_parameters()} - set(incoming))
        unknown = sorted(set(incoming) - set(targets))
        if missing or unknown:
            raise ValueError(f"weights: parameters missing from the update {missing[:5]}, unknown to the model {unknown[:5]}")
        shapes = [(name, tuple(t.shape), tuple(targets[name].shape)) for name, t in incoming.items() if t.shape != targets[name].shape]
        if shapes:
            raise ValueError(f"weights: shape mismatch (name, sent, model): {shapes[:5]}")
        for name, tensor in incoming.items():
            targets[name].data.copy_(tensor)

    def receive_weights(self, ticket: TransferTicket, address: StoreAddress, transfer_ranks: Sequence[int],
                        version: Optional[int] = None) -> UpdateOutcome:
        staged: dict[str, torch.Tensor] = {}
        try:
            if not receive_update(address, ticket, transfer_ranks[0], device=torch.device("cpu"), sink=staged.__setitem__,
                                  buffers=self.staging, groups=self.groups, staging=self.buckets):
                return UpdateOutcome.NOT_SELECTED
            self.load_weights(staged.items())
        except (TransferFailed, ValueError) as error:
            log.warning("cpu backend: weight update %s not loaded, keeping the old weights: %s", ticket.id, error)
            return UpdateOutcome.FAILED_INTACT
        return UpdateOutcome.LOADED

    def close(self) -> None:
        """Drop the kept transfer group."""
        self.groups.close()
