"""Reward code from spec.rollout.task.rewardSource: loaded from a file as the module rewardFunction names (the files
beside it importable), and every way it can fail to load reported in one line with the file and line, as the rollout
pod's termination message carries it to RolloutReady."""

from __future__ import annotations

import os
import subprocess
import sys
from source_tree import pythonpath
from pathlib import Path

import pytest
import yaml

from rollout_harness import make_config, tiny_model, wait_until
from rljob_api import constants as c
from rljob_api import protocol
from rljob_api.spec import RewardSourceSpec, RLTrainingJobSpec
from rljob_rollout.__main__ import reward_file
from rljob_rollout.tasks import build_task, load_reward_function
from rljob_wire.model import build_tokenizer
from rljob_trainer.weight_publisher import WeightPublisher

REPO = Path(__file__).resolve().parents[2]
SOURCE = RewardSourceSpec.model_validate({"configMapKeyRef": {"name": "rewards", "key": "reward.py"}})
REWARD = "import scoring\n\ndef score(prompt, completion, record):\n    return scoring.VALUE * record['scale']\n"
SCORING = "VALUE = 0.125\n"


@pytest.fixture()
def mounted(tmp_path):
    """A directory laid out as the kubelet mounts a ConfigMap: every key a file (a key need not end in .py). The
    modules it loads are taken out of sys.modules afterwards."""
    directory = tmp_path / "etc-rljob-reward"
    directory.mkdir()
    before = set(sys.modules)
    yield directory
    for name in set(sys.modules) - before:
        if name.startswith(("src_test_", "scoring", "letters_reward")):
            del sys.modules[name]
    if str(directory) in sys.path:
        sys.path.remove(str(directory))


def _load(directory: Path, files: dict[str, str], module: str = "src_test_reward", key: str = "reward.py"):
    for name, text in files.items():
        (directory / name).write_text(text)
    return load_reward_function(f"{module}:score", str(directory / key), SOURCE)


def test_the_file_is_loaded_as_the_named_module_and_imports_the_files_beside_it(mounted):
    score = _load(mounted, {"reward.py": REWARD, "scoring.py": SCORING})
    assert score("p", "c", {"scale": 4}) == 0.5
    assert sys.modules["src_test_reward"].__file__ == str(mounted / "reward.py")


def test_a_key_without_a_py_suffix_loads_too(mounted):
    score = _load(mounted, {"score": "def score(p, c, r):\n    return 0.75\n"}, module="src_test_bare", key="score")
    assert score("p", "c", {}) == 0.75


def test_the_source_wins_over_a_module_of_the_same_name_in_the_image(mounted, tmp_path, monkeypatch):
    image = tmp_path / "site"
    image.mkdir()
    (image / "src_test_shadowed.py").write_text("def score(p, c, r):\n    return -1.0\n")
    monkeypatch.syspath_prepend(str(image))
    score = _load(mounted, {"reward.py": "def score(p, c, r):\n    return 1.0\n"}, module="src_test_shadowed")
    assert score("p", "c", {}) == 1.0


@pytest.mark.parametrize("files, where, error", [
    ({"reward.py": "def score(p, c, r):\n    return (1.0\n"},
     "reward.py:2 (ConfigMap rewards, key reward.py)", "SyntaxError: '(' was never closed"),
    ({"reward.py": "def score(p, c, r):\n  return 1.0\n    x = 2\n"},
     "reward.py:3 (ConfigMap rewards, key reward.py)", "IndentationError: unexpected indent"),
    ({"reward.py": "import os\nimport src_test_not_installed\n"},
     "reward.py:2 (ConfigMap rewards, key reward.py)", "ModuleNotFoundError: No module named 'src_test_not_installed'"),
    ({"reward.py": "import scoring\n", "scoring.py": "TABLE = {}\nVALUE = TABLE['x']\n"},  # a file beside it fails
     "scoring.py:2 (ConfigMap rewards, key scoring.py)", "KeyError: 'x'"),
    ({"reward.py": "import scoring\n", "scoring.py": "VALUE = [\n"},
     "scoring.py:1 (ConfigMap rewards, key scoring.py)", "SyntaxError: '[' was never closed"),
])
def test_a_module_that_does_not_load_is_reported_with_its_file_and_line(mounted, files, where, error):
    with pytest.raises(ValueError) as raised:
        _load(mounted, files)
    assert str(raised.value) == f"spec.rollout.task.rewardSource: {mounted}/{where}: {error}"
    assert "src_test_reward" not in sys.modules


def test_a_missing_file_or_function_is_named():
    with pytest.raises(ValueError) as raised:
        load_reward_function("src_test_reward:score", "/nonexistent/reward.py", SOURCE)
    assert str(raised.value) == ("spec.rollout.task.rewardSource: no file at /nonexistent/reward.py (ConfigMap rewards, "
                                 "key reward.py)")


@pytest.mark.parametrize("module", ["json", "numpy.linalg"])
def test_a_module_name_the_process_has_imported_is_refused(mounted, module):
    with pytest.raises(ValueError) as raised:
        _load(mounted, {"reward.py": "def score(p, c, r):\n    return 1.0\n"}, module=module)
    assert str(raised.value) == (f"spec.rollout.task.rewardFunction: the module name {module!r} is taken by a module "
                                 "the rollout process has imported already; give the reward module another name")
    assert sys.modules["json"].dumps([1]) == "[1]"


def test_no_function_of_that_name(mounted):
    with pytest.raises(ValueError, match="spec.rollout.task.rewardFunction: 'src_test_reward' has no callable 'score'"):
        _load(mounted, {"reward.py": "scores = 1\n"})


def test_the_file_comes_from_env_and_is_required_with_a_source(redis_server):
    config = make_config(redis_server, rollout={"task": {"name": "custom", "datasetPath": "/d.jsonl",
                                                         "rewardFunction": "m:f", "rewardSource": {"path": "/r/m.py"}}})
    assert reward_file(config, {c.ENV_REWARD_SOURCE: "/r/m.py"}) == "/r/m.py"
    with pytest.raises(ValueError, match="env RLJOB_REWARD_SOURCE: required with spec.rollout.task.rewardSource"):
        reward_file(config, {})
    assert reward_file(make_config(redis_server), {c.ENV_REWARD_SOURCE: "/r/m.py"}) is None


def _rollout(config_path: Path, password: str, reward: Path, **popen) -> subprocess.Popen:
    """``python -m rljob_rollout`` as the rollout pod runs it, with the reward file where the pod's env names it."""
    env = dict(os.environ, RLJOB_CONFIG=str(config_path), REDIS_PASSWORD=password, RLJOB_REPLICA_INDEX="0",
               OMP_NUM_THREADS="1", **{c.ENV_REWARD_SOURCE: str(reward)})
    env["PYTHONPATH"] = pythonpath(env)
    return subprocess.Popen([sys.executable, "-m", "rljob_rollout"], env=env, text=True, start_new_session=True,
                            **popen)


def _job(redis_server, tmp_path, mounted):
    config = make_config(redis_server, rollout={
        "maxLag": 10_000_000, "sampling": {"maxNewTokens": 4},
        "task": {"name": "custom", "datasetPath": str(mounted / "prompts.jsonl"), "rewardFunction": "src_test_job:score",
                 "rewardSource": {"configMapKeyRef": {"name": "rewards", "key": "reward.py"}}}},
        redis={"maxPending": 10_000_000}).model_copy(update={"metrics_port": 0})
    (mounted / "prompts.jsonl").write_text('{"prompt": "ab", "scale": 2}\n{"prompt": "cd", "scale": 2}\n')
    path = tmp_path / "config.json"
    path.write_text(config.to_json())
    return config, path


@pytest.mark.timeout(180)
def test_the_rollout_process_scores_with_the_mounted_reward_and_its_helper(redis_server, tmp_path, mounted):
    """The entry point loads reward.py from the mounted directory (it imports scoring.py beside it; the dataset is a
    key of the same ConfigMap), generates with the trainer's weights and writes rewards 0.125 × 2 for every sample; as
    the second start of its replica index (a re-created pod), whose task is built once with its own seed."""
    config, path = _job(redis_server, tmp_path, mounted)
    (mounted / "reward.py").write_text(REWARD)
    (mounted / "scoring.py").write_text(SCORING)
    client = redis_server.client()
    client.hset(config.keys.rollout, f"{protocol.ROLLOUT_STARTS_PREFIX}0", 1)  # a re-created pod: its own prompt seed
    publisher = WeightPublisher(config, client, join_timeout_s=10, transfer_timeout_s=30, poll_interval_s=0.3)
    log = tmp_path / "rollout.log"
    with log.open("w") as out:
        proc = _rollout(path, redis_server.password, mounted / "reward.py", stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: client.hlen(config.keys.members) == 1 or proc.poll() is not None, 90,
                   "the rollout process to join the weight transfer", lambda: log.read_text()[-3000:])
        assert proc.poll() is None, log.read_text()[-3000:]
        assert client.hget(config.keys.rollout, f"{protocol.ROLLOUT_STARTS_PREFIX}0") == b"2"
        assert publisher.publish(tiny_model(config, 1).named_parameters(), step=0, documents_seen=0) == 1
        wait_until(lambda: protocol.rewards_by_version(client.hgetall(config.keys.rollout)).get(0, (0, 0))[1] >= 32,
                   60, "two batches scored", lambda: log.read_text()[-3000:])
        mean, count = protocol.rewards_by_version(client.hgetall(config.keys.rollout))[0]
        assert mean == 0.25 and count % 16 == 0
        assert client.xlen(config.keys.stream) >= count  # written as scored (more batches may have come since)
        publisher.finish(step=1, documents_seen=16)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        publisher.close()


@pytest.mark.timeout(120)
def test_the_rollout_process_with_a_syntax_error_exits_2_naming_the_file_and_line_last(redis_server, tmp_path,
                                                                                     mounted):
    """What the kubelet keeps as the termination message (FallbackToLogsOnError: the log's tail) ends with the line
    the operator quotes in RolloutReady."""
    _, path = _job(redis_server, tmp_path, mounted)
    (mounted / "reward.py").write_text("import math\n\ndef score(prompt, completion, record)\n    return 1.0\n")
    proc = _rollout(path, redis_server.password, mounted / "reward.py", stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert last.endswith(f"ERROR rljob_rollout: rollout: cannot start: spec.rollout.task.rewardSource: "
                         f"{mounted}/reward.py:3 (ConfigMap rewards, key reward.py): SyntaxError: expected ':'"), out
    assert "Traceback" not in out


def test_the_examples_reward_loads_from_its_configmap_and_scores_its_prompts(mounted):
    """examples/rljob-cpu-configmap-reward.yaml's ConfigMap, mounted: the custom task reads the prompts key and scores
    with reward.py, which imports scoring.py beside it."""
    documents = [d for d in yaml.safe_load_all((REPO / "examples" / "rljob-cpu-configmap-reward.yaml").read_text()) if d]
    (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
    (manifest,) = [d for d in documents if d["kind"] == c.KIND]
    for key, text in config_map["data"].items():
        (mounted / key).write_text(text)
    spec = RLTrainingJobSpec.model_validate(manifest["spec"])
    source = spec.rollout.task.reward_source.config_map_key_ref
    task_spec = spec.rollout.task.model_copy(update={"dataset_path": str(mounted / "prompts.jsonl")})
    task = build_task(task_spec, build_tokenizer(spec.model, spec.rollout.task), seed=0,
                      reward_file=str(mounted / source.key))
    prompt = next(p for p in task.next_prompts(5) if p.record["letter"] == "a")
    assert prompt.text == "say aaa"
    assert task.reward(prompt, [], "abca") == 0.5
    assert task.reward(prompt, [], "") == 0.0
