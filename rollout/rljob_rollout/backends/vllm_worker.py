"""The vLLM worker extension that joins rljob's weight transfer inside every vLLM GPU worker process.

vLLM mixes this class into its GPU worker (``LLM(worker_extension_cls=...)``, the mechanism of vLLM's RLHF
examples), so each tensor-parallel worker t of rollout pod i joins the transfer group itself as transfer rank
``base_rank + t`` (DESIGN §2), receives every full tensor onto its own GPU (NCCL tickets) or into host memory
(gloo tickets) and hands it to the model's ``load_weights``, which keeps the worker's tensor-parallel shard.

Loading is tensor by tensor, as vLLM's own weight updates are: no second copy of the model is held. The transfer
group is kept in the worker between updates while the trainer keeps it too (:class:`~rljob_wire.transfer.
GroupKeeper`, attribute ``rljob_groups``). The price
is that a transfer failing half-way leaves mixed weights; :meth:`rljob_receive_weights` then reports
``failed_torn`` and the rollout worker generates nothing until the next complete update.

This module imports nothing from vLLM, so it loads (and is tested) without it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rljob_api.protocol import TransferTicket
from rljob_wire.transfer import GroupKeeper, StoreAddress, TransferFailed, receive_update

log = logging.getLogger(__name__)


class WeightReceiverExtension:
    """Methods added to vLLM's GPU worker (uses the worker's ``model_runner``, ``device`` and ``rank``)."""

    def rljob_receive_weights(self, ticket: dict[str, Any], host: str, port: int, base_rank: int) -> dict[str, Any]:
        """Join one update as transfer rank ``base_rank + self.rank`` and load every tensor into the model.

        Args:
            ticket: :meth:`TransferTicket.to_json` of the update.
            host, port: the trainer's transfer store.
            base_rank: transfer rank of this pod's GPU process 0.

        Returns:
            ``{"outcome": "loaded" | "not_selected" | "failed", "tensors_loaded": int, "error": str}``.
        """
        parsed = TransferTicket.from_json(ticket)
        rank = base_rank + int(getattr(self, "rank", 0))
        model = self.model_runner.model
        device = torch.device(self.device) if parsed.backend == "nccl" else torch.device("cpu")

        loaded = 0

        def load(name: str, tensor: torch.Tensor) -> None:
            nonlocal loaded
            model.load_weights(weights=[(name, tensor)])
            loaded += 1

        groups = getattr(self, "rljob_groups", None)
        if groups is None:
            groups = self.rljob_groups = GroupKeeper()
        try:
            selected = receive_update(StoreAddress(host, port), parsed, rank, device=device, sink=load, groups=groups)
        except TransferFailed as error:
            log.warning("vllm worker %d: weight update %s failed: %s", rank, parsed.id, error)
            return {"outcome": "failed", "tensors_loaded": error.tensors_loaded, "error": str(error)}
        return {"outcome": "loaded" if selected else "not_selected", "tensors_loaded": loaded, "error": ""}
