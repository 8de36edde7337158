"""The demo's final report: each condition once, echoed messages not repeated."""

from __future__ import annotations

import pytest

from rljob_localcluster.demo import condition_lines


def test_conditions_that_echo_the_finish_are_printed_once():
    done = "trainer pod demo-trainer-0 (global rank 0) of attempt 0 exited 0; final weights exported to /x"
    conditions = [
        {"type": "Valid", "status": "True", "reason": "SpecValid", "message": "the spec is valid"},
        {"type": "RolloutReady", "status": "False", "reason": "TrainingFinished", "message": done},
        {"type": "Running", "status": "False", "reason": "TrainingFinished", "message": done},
        {"type": "Succeeded", "status": "True", "reason": "TrainingFinished", "message": done},
    ]
    assert [line.split(None, 3)[3] for line in condition_lines(conditions)] == [
        "the spec is valid", done, "(as RolloutReady)", "(as RolloutReady)"]
    assert condition_lines(conditions)[0] == f"  {'Valid':<13} {'True':<6} {'SpecValid':<18} the spec is valid"


def test_the_demo_refuses_a_running_cluster_without_nodes_or_with_a_failed_node(tmp_path):
    from rljob_localcluster import demo

    state = {"server": "https://127.0.0.1:1", "phase": "ready", "nodes": None}
    with pytest.raises(demo.DemoError, match=r"runs without nodes \(up --nodes 0\)"):
        demo.reuse(tmp_path, state)
    state["nodes"] = {"nodes": {"rljob-node-0": {"containerd_socket": str(tmp_path / "none.sock")}}}
    state["exited"] = {"kubelet-rljob-node-0": 0}
    with pytest.raises(demo.DemoError, match=r"exited \{'kubelet-rljob-node-0': 0\} \(status: DEGRADED\)"):
        demo.reuse(tmp_path, state)
