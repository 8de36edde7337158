"""The vLLM worker extension that joins rljob's weight transfer inside every vLLM worker process.

vLLM mixes this class into its worker (``LLM(worker_extension_cls=...)``, the mechanism of vLLM's RLHF examples), so
each tensor-parallel worker t of rollout pod i joins the transfer group itself as transfer rank ``base_rank + t``
(DESIGN §2), receives every full tensor onto its own GPU (NCCL tickets) or into host memory (gloo tickets) and hands it
to vLLM's in-place reload (``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``), which keeps the
worker's tensor-parallel shard and redoes the processing vLLM applies after a load (on CPU, the oneDNN repacking of
every linear layer: loading tensor by tensor through ``model.load_weights`` fails after the first one there).

The transfer pushes tensors (:func:`~rljob_wire.transfer.receive_update` calls a sink) and the reload pulls them (it
reads an iterator): a thread receives into a queue of at most :data:`QUEUE_DEPTH` tensors while the worker's thread
loads from it, so no second copy of the model is held. The transfer group is kept in the worker between updates while
the trainer keeps it too (:class:`~rljob_wire.transfer.GroupKeeper`, attribute ``rljob_groups``). A transfer failing
half-way leaves mixed weights; :meth:`rljob_receive_weights` then reports ``failed`` with the tensors loaded and the
rollout worker generates nothing until the next complete update. One failing before its first tensor loads nothing.

Everything crossing :meth:`collective_rpc` is JSON, strings and integers: vLLM's default multi-process executor
serialises nothing else without ``VLLM_ALLOW_INSECURE_SERIALIZATION``. This module imports nothing from vLLM, so it
loads (and is tested at its boundary) without it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator, Optional

import torch

from rljob_api.protocol import TransferTicket
from rljob_wire.transfer import GroupKeeper, StoreAddress, TransferFailed, receive_update

log = logging.getLogger(__name__)

QUEUE_DEPTH = 2
"""Received tensors waiting for the reload at most (each a full tensor of the model)."""
_END = object()


class WeightReceiverExtension:
    """Methods added to vLLM's worker (uses the worker's ``reload_weights``, ``device`` and ``rank``)."""

    def rljob_receive_weights(self, ticket: dict[str, Any], host: str, port: int, base_rank: int) -> dict[str, Any]:
        """Join one update as transfer rank ``base_rank + self.rank`` and reload the model from what arrives.

        Args:
            ticket: :meth:`TransferTicket.to_json` of the update.
            host, port: the trainer's transfer store.
            base_rank: transfer rank of this pod's process 0.

        Returns:
            ``{"outcome": "loaded" | "not_selected" | "failed", "tensors_loaded": int, "error": str}``.
        """
        parsed = TransferTicket.from_json(ticket)
        rank = base_rank + int(getattr(self, "rank", 0))
        device = torch.device(self.device) if parsed.backend == "nccl" else torch.device("cpu")
        groups = getattr(self, "rljob_groups", None)
        if groups is None:
            groups = self.rljob_groups = GroupKeeper()
        arrived: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
        result: dict[str, Any] = {}

        def receive() -> None:
            try:
                result["selected"] = receive_update(StoreAddress(host, port), parsed, rank, device=device,
                                                    sink=lambda name, tensor: arrived.put((name, tensor)),
                                                    groups=groups)
            except TransferFailed as error:
                result["error"] = error
            finally:
                arrived.put(_END)

        receiver = threading.Thread(target=receive, name=f"rljob-receive-{parsed.id}", daemon=True)
        receiver.start()
        loaded, load_error, ended = 0, None, False
        first = arrived.get()
        if first is _END:
            ended = True
        else:
            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal loaded, ended
                item = first
                while item is not _END:
                    loaded += 1  # handed to the reload: from here on the old weights may be gone
                    yield item
                    item = arrived.get()
                ended = True

            try:
                self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
            except Exception as error:  # noqa: BLE001 - any loader error tears the update
                load_error = error
        while not ended:  # what the reload did not read: the transfer goes on to its end for the other ranks
            ended = arrived.get() is _END
        receiver.join()
        error: Optional[BaseException] = result.get("error") or load_error
        if error is not None:
            log.warning("vllm worker %d: weight update %s failed after %d tensors: %s", rank, parsed.id, loaded, error)
            return {"outcome": "failed", "tensors_loaded": loaded, "error": str(error)}
        return {"outcome": "loaded" if result.get("selected") else "not_selected", "tensors_loaded": loaded,
                "error": ""}

    def rljob_load_file(self, path: str) -> int:
        """Reload the model from the safetensors file at ``path`` (Hugging Face names, full tensors); returns the
        tensors read."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as weights:
            names = list(weights.keys())
            self.reload_weights(weights_iterator=((name, weights.get_tensor(name)) for name in names),
                                is_checkpoint_format=True)
        return len(names)

