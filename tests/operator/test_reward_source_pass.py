"""spec.rollout.task.rewardSource against the real API server of the local control plane (no kubelet: pod status is
written as a kubelet writes it) and a real Redis, with the real rollout process: the CRD refuses a source no pod could
use; a missing ConfigMap, then a syntax error in it, reach RolloutReady (the error with its file and line, from the
rollout process's own output); each edit of the ConfigMap replaces the rollout pod and never the trainer gang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from source_tree import pythonpath
from pathlib import Path

import pytest

from helm_tools import helm_binary
from rljob_api import constants as c
from rljob_api import protocol
from test_cluster import Kube, job_manifest, kubelet_status
from test_pass import pass_with_pods, uids

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(helm_binary() is None, reason="helm is not built: run localcluster/build-go-tools.sh"),
]

from test_cluster import installed, kube, namespace  # noqa: E402,F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]
SOURCE = {"configMapKeyRef": {"name": "rewards", "key": "reward.py"}}
PROMPTS = '{"prompt": "ab"}\n{"prompt": "cd"}\n'
BROKEN = "import math\n\ndef score(prompt, completion, record)\n    return 1.0\n"
FIXED = "import math\n\ndef score(prompt, completion, record):\n    return 1.0\n"


def task(**changes) -> dict:
    return {"name": "custom", "datasetPath": "/etc/rljob-reward/prompts.jsonl", "rewardFunction": "cp_reward:score",
            "rewardSource": SOURCE, **changes}


def test_the_api_server_refuses_a_reward_source_no_pod_could_use(kube: Kube, installed, namespace):
    def refused(rollout_task: dict) -> str:
        result = kube.apply(job_manifest("src", rollout={"task": rollout_task}), namespace, check=False)
        assert result.returncode != 0, f"accepted: {rollout_task}"
        return result.stderr

    assert ("spec.rollout.task.rewardSource: Invalid value: \"object\": rewardSource needs exactly one of "
            "configMapKeyRef or path") in refused(task(rewardSource={**SOURCE, "path": "/r/reward.py"}))
    assert "rewardSource needs exactly one of configMapKeyRef or path" in refused(task(rewardSource={}))
    assert ("spec.rollout.task.rewardSource.volume: Invalid value: \"object\": rewardSource.volume needs path, the "
            "module's file on that volume") in refused(task(rewardSource={**SOURCE, "volume": "claim"}))
    assert ("spec.rollout.task.rewardSource: Invalid value: \"object\": rewardSource needs name custom: the built-in "
            "tasks score with their own rewards") in refused({"name": "digits-copy", "rewardSource": SOURCE})
    assert "spec.rollout.task.rewardSource.path: Invalid value: \"reward.py\"" in refused(
        task(rewardSource={"path": "reward.py"}))
    assert "spec.rollout.task.rewardSource.configMapKeyRef.key: Invalid value: \"code/reward.py\"" in refused(
        task(rewardSource={"configMapKeyRef": {"name": "rewards", "key": "code/reward.py"}}))
    assert kube.apply(job_manifest("src", rollout={"task": task()}), namespace).returncode == 0


def kubelet_tail(log: str) -> str:
    """The termination message a kubelet keeps of a container that failed without writing one (FallbackToLogsOnError):
    the last 80 lines of its log, at most 2048 bytes."""
    text = "".join(log.splitlines(keepends=True)[-80:])
    return text.encode()[-2048:].decode(errors="ignore")


def mount(kube: Kube, namespace: str, directory: Path) -> Path:
    """Write every key of the ConfigMap rewards into ``directory``, as the kubelet mounts it."""
    directory.mkdir(parents=True)
    for key, text in kube.json("get", "configmap", "rewards", "-n", namespace)["data"].items():
        (directory / key).write_text(text)
    return directory


def rollout_process(kube: Kube, namespace: str, job: str, tmp_path: Path, password: str,
                    **popen) -> subprocess.Popen:
    """``python -m rljob_rollout`` with the job's recorded config (its ConfigMap) and the rollout pod's env, the reward
    ConfigMap's keys mounted in a directory of ``tmp_path`` that env RLJOB_REWARD_SOURCE points into."""
    mounted = mount(kube, namespace, tmp_path / "etc-rljob-reward")
    config = tmp_path / "config.json"
    config.write_text(kube.json("get", "configmap", f"{job}-config", "-n", namespace)["data"]["config.json"])
    env = dict(os.environ, RLJOB_CONFIG=str(config), REDIS_PASSWORD=password, RLJOB_REPLICA_INDEX="0",
               POD_IP="127.0.0.1", OMP_NUM_THREADS="1", **{c.ENV_REWARD_SOURCE: str(mounted / "reward.py")})
    env["PYTHONPATH"] = pythonpath(env)
    return subprocess.Popen([sys.executable, "-m", "rljob_rollout"], env=env, text=True, start_new_session=True,
                            **popen)


def rollout_pod(kube: Kube, namespace: str) -> dict:
    (pod,) = [p for p in kube.pods(namespace, "rollout") if not p["metadata"].get("deletionTimestamp")]
    return pod


def config_map(text: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "rewards"},
            "data": {"reward.py": text, "README": "reward code of job rs\n"}}


@pytest.mark.timeout(600)
def test_a_reward_configmap_missing_then_broken_then_fixed_is_reported_and_replaces_only_the_rollout_pod(
        kube: Kube, installed, namespace, redis_server, tmp_path):
    kube.run("create", "secret", "generic", "shared-redis", "-n", namespace,
             f"--from-literal=password={redis_server.password}")
    prompts = tmp_path / "prompts.jsonl"  # where the process run below finds it (no pod here mounts anything)
    prompts.write_text(PROMPTS)
    kube.apply(job_manifest("rs", rollout={"task": task(datasetPath=str(prompts)), "sampling": {"maxNewTokens": 4}},
                            redis={"mode": "external", "url": redis_server.url,
                                   "passwordSecretRef": {"name": "shared-redis", "key": "password"}}), namespace)

    # 1. No ConfigMap yet: named in RolloutReady; the pod is made all the same (the kubelet mounts it once it exists).
    events: list = []
    pass_with_pods(installed, kube, namespace, "rs", events=events)
    ready = kube.condition(namespace, "rs", "RolloutReady")
    assert (ready["status"], ready["reason"], ready["message"]) == ("False", "RewardSourceMissing", (
        f"ConfigMap rewards (spec.rollout.task.rewardSource.configMapKeyRef) not found in namespace {namespace}: "
        "rollout pods cannot start until it exists (running ones keep the reward code they loaded)"))
    assert ("Warning", "RewardSourceMissing") in [(e.type, e.reason) for e in events]
    trainers = uids(kube, namespace, "trainer")
    assert len(trainers) == 2
    pod = rollout_pod(kube, namespace)
    assert {"name": "reward-source", "configMap": {"name": "rewards", "defaultMode": 0o644}} in pod["spec"]["volumes"]
    (container,) = pod["spec"]["containers"]
    assert {"name": c.ENV_REWARD_SOURCE, "value": "/etc/rljob-reward/reward.py"} in container["env"]
    assert c.LABEL_REWARD_SOURCE_HASH not in pod["metadata"]["labels"]

    # 2. The ConfigMap appears with a syntax error: the rollout pod is made again, labelled with its content.
    kube.apply(config_map(BROKEN), namespace)
    requests = pass_with_pods(installed, kube, namespace, "rs")
    assert (requests[("create", "pods")], requests[("delete", "pods")]) == (0, 1)
    pass_with_pods(installed, kube, namespace, "rs")
    broken = rollout_pod(kube, namespace)
    assert broken["metadata"]["uid"] != pod["metadata"]["uid"]
    assert len(broken["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH]) == 16
    assert kube.condition(namespace, "rs", "RolloutReady")["reason"] == "PodsNotReady"

    # The rollout process as the pod runs it, on those files: it exits 2; its log's tail is the termination message.
    proc = rollout_process(kube, namespace, "rs", tmp_path / "broken", redis_server.password, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    kubelet_status(kube, namespace, broken["metadata"]["name"], "Running", {
        "name": "rollout", "restartCount": 1,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 2, "reason": "Error", "message": kubelet_tail(out)}}})
    pass_with_pods(installed, kube, namespace, "rs")
    ready = kube.condition(namespace, "rs", "RolloutReady")
    assert (ready["status"], ready["reason"]) == ("False", "ContainerFailing")
    assert ready["message"].startswith("0/1 rollout pods ready; failing: rs-rollout-0: container rollout "
                                       "CrashLoopBackOff, 1 restart; last run: exit code 2 (Error): ")
    assert ready["message"].endswith(
        f"ERROR rljob_rollout: rollout: cannot start: spec.rollout.task.rewardSource: "
        f"{tmp_path}/broken/etc-rljob-reward/reward.py:3 (ConfigMap rewards, key reward.py): SyntaxError: expected ':'")

    # 3. The fix: the rollout pod is replaced, the trainer gang is not; the fixed code loads and joins the transfer.
    kube.apply(config_map(FIXED), namespace)
    requests = pass_with_pods(installed, kube, namespace, "rs")
    assert requests[("delete", "pods")] == 1
    pass_with_pods(installed, kube, namespace, "rs")
    fixed = rollout_pod(kube, namespace)
    assert fixed["metadata"]["uid"] != broken["metadata"]["uid"]
    assert fixed["metadata"]["labels"][c.LABEL_REWARD_SOURCE_HASH] != broken["metadata"]["labels"][
        c.LABEL_REWARD_SOURCE_HASH]
    assert uids(kube, namespace, "trainer") == trainers
    assert kube.job(namespace, "rs")["status"]["restarts"] == 0
    requests = pass_with_pods(installed, kube, namespace, "rs")  # the same content: nothing more to do
    assert (requests[("create", "pods")], requests[("delete", "pods")]) == (0, 0)

    log = tmp_path / "fixed.log"
    with log.open("w") as output:
        proc = rollout_process(kube, namespace, "rs", tmp_path / "fixed", redis_server.password, stdout=output,
                               stderr=subprocess.STDOUT)
    try:
        members = protocol.key_prefix(namespace, "rs") + protocol.KEY_MEMBERS
        client, deadline = redis_server.client(), time.monotonic() + 120
        while not client.hlen(members):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert list(client.hkeys(members)) == [b"1"]  # rollout pod 0's transfer rank: it loaded the reward and waits
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    assert json.loads(kube.json("get", "configmap", "rs-config", "-n", namespace)["data"]["config.json"])[
        "spec"]["rollout"]["task"]["rewardSource"]["configMapKeyRef"] == SOURCE["configMapKeyRef"]
