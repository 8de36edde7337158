"""The cluster half of the autoscaling benchmark (benchmarks/autoscale_cluster.py) without a cluster: the changes read
from polls, when a run counts as settled, what a reversal is, and that the job it applies is a valid spec."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import autoscale_cluster as ac  # noqa: E402
from rljob_api.spec import RLTrainingJobSpec  # noqa: E402
from rljob_api.validation import check_spec  # noqa: E402

C = ac.COOLDOWN_S


def polls(*points: tuple[float, int | None]) -> list[ac.Sample]:
    return [ac.Sample(t, replicas, step=i) for i, (t, replicas) in enumerate(points)]


def test_changes_are_read_from_the_polls_skipping_those_without_a_count():
    samples = polls((0, None), (5, 1), (10, 1), (15, None), (20, 3), (25, 3), (30, 2))
    assert ac.changes_of(samples) == [ac.Change(20, 1, 3), ac.Change(30, 3, 2)]


def test_a_count_held_for_two_cooldowns_after_its_last_change_is_balanced():
    v = ac.judge(0, polls((0, 1), (60, 3), (60 + 2 * C, 3)))
    assert v.settled_since == 60 and v.reversals == 0 and v.balanced
    assert not ac.judge(0, polls((0, 1), (60, 3), (60 + 2 * C - 1, 3))).balanced  # not held long enough
    assert ac.judge(0, polls((0, 1), (2 * C, 1))).settled_since == 0  # no change at all: balanced from the start


def test_too_many_decisions_are_not_balanced():
    counts = [1, 2, 3, 2, 3, 2, 3]
    t = [i * 4 * C for i in range(len(counts))]  # far apart: no reversal, but six decisions
    v = ac.judge(0, polls(*zip(t, counts), (t[-1] + 3 * C, 3)))
    assert len(v.changes) == 6 and v.reversals == 0 and not v.balanced


@pytest.mark.parametrize("gap, reversals", [(C, 1), (3 * C - 1, 1), (3 * C, 0)])
def test_a_change_undone_within_three_cooldowns_is_a_reversal(gap, reversals):
    v = ac.judge(0, polls((0, 1), (100, 3), (100 + gap, 2), (100 + gap + 2 * C, 2)))
    assert v.reversals == reversals


def test_no_polls_is_an_error():
    with pytest.raises(ValueError, match="never polled"):
        ac.judge(0, [])


def test_the_job_is_valid_rollout_bound_and_autoscaled():
    manifest = ac.job_manifest(2)
    spec = RLTrainingJobSpec.model_validate(manifest["spec"])
    assert check_spec(spec) == []
    assert spec.trainer.seed == spec.rollout.seed == 2
    batch = spec.rollout.prompts_per_batch * spec.rollout.samples_per_prompt
    assert batch * 8 == spec.trainer.batch.documents_per_step  # a worker's batch is an eighth of a step
    assert (spec.rollout.autoscaling.min_replicas, spec.rollout.autoscaling.max_replicas) == (1, ac.MAX_REPLICAS)
    assert spec.trainer.checkpoint.volume is None and not spec.redis.persistence.enabled
