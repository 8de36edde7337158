"""The rollout entry point as a pod runs it (``python -m rljob_rollout``) on a model it cannot load or a backend its
image lacks: it exits 78 before touching Redis, its termination message file holds the one permanent line naming the
field and its value, and the same line ends its log (rljob_api.start_failure; the operator fails the job on it)."""

from __future__ import annotations

import importlib.util

import pytest

from rljob_api.config import RedisConnection, resolve
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.start_failure import PERMANENT, permanent
from start_cases import UNLOADABLE, run_entry, unloadable


def rollout_of(tmp_path, spec: dict, extra: dict):
    config = tmp_path / "config.json"
    config.write_text(resolve("job", "ns", RLTrainingJobSpec.model_validate(spec),
                              RedisConnection(host="127.0.0.1", port=1)).to_json())  # never reached
    return run_entry(["-m", "rljob_rollout"], config, tmp_path / "termination-log", extra)


@pytest.mark.parametrize("case", UNLOADABLE)
def test_a_model_the_rollout_cannot_load_ends_it_with_the_permanent_line(tmp_path, case):
    model, extra, said = unloadable(case, tmp_path)
    ended = rollout_of(tmp_path, {"model": model}, extra)
    assert ended.returncode == 78, ended.stderr[-3000:]
    assert ended.termination.startswith(PERMANENT + said), ended.termination
    assert ended.termination.endswith("\n") and ended.termination.count("\n") == 1
    assert ended.last_line.endswith(" ERROR rljob_rollout: rollout: " + ended.termination.strip())
    assert permanent(ended.termination) == ended.termination.strip()[len(PERMANENT):]


def test_the_vllm_backend_on_an_image_without_vllm_ends_it_with_the_permanent_line(tmp_path):
    assert importlib.util.find_spec("vllm") is None  # the tests' Python never has vLLM (scripts/vllm-venv.sh does)
    ended = rollout_of(tmp_path, {"model": {"source": "tiny"}, "rollout": {
        "backend": "vllm", "gpusPerReplica": 1, "image": "example.org/no-vllm:1"}}, {})
    assert ended.returncode == 78, ended.stderr[-3000:]
    assert ended.termination == (
        PERMANENT + "spec.rollout.backend: 'vllm' needs vLLM, which the rollout image 'example.org/no-vllm:1' does not "
        "have: set spec.rollout.image to an image with vLLM (GPUs: trainer_image/Dockerfile.vllm; gpusPerReplica 0: "
        "rljob/trainer-cpu, trainer_image/Dockerfile.cpu), or backend to 'cpu'\n")
