"""Multi-turn episodes end to end (issue 27 item 5) and rollouts scaled without restarting anything (issue 28, without
Kueue): ``examples/rljob-environment-cpu.yaml`` (guess the number, its OpenEnv server run by the operator from the
trainer image) with a smaller batch, on the local cluster.

While the job runs, from outside:

1. the operator-run environment is checked as rendered (a Deployment, a Service, a NetworkPolicy; its pod non-root on
   a read-only root filesystem without a service-account token) and EnvironmentReady becomes True;
2. documents are read from the stream: every one is a whole episode whose tokens are exactly its sampled ids plus the
   environment's answers encoded once (a game against some secret replays them), whose masked spans hold every token
   the model did not sample, with per-token weights versions across turns; episodes of 3 turns and more are there;
3. ``kubectl scale`` (the /scale subresource) takes the rollouts to 2 replicas: the new one loads the weights, then
   generates; nothing of the trainer gang or the first rollout pod is replaced;
4. the environment pod is killed (no grace period): the episodes it held are dropped and counted in the rollout hash,
   the Deployment's next pod serves, the job goes on;
5. ``kubectl scale`` back to 1: the second rollout pod drains and goes, nothing else is replaced.

The job ends Succeeded on its first attempt, every document trained once, none lost or dead-lettered, and the
environment server is scaled to 0.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from guess_replay import secrets_replaying
from rljob_api import constants as c
from rljob_api.spec import RLTrainingJobSpec
from rljob_wire.model import build_tokenizer

from .conftest import check_trained_once, condition, get_job, load_example, phase, redis_snapshot, wait_for

pytestmark = pytest.mark.e2e

MAX_STEPS = 100
"""Steps: enough for the scale-up, the environment pod's death and the scale-down to happen while it trains (40 were
all done before the scale-down on a machine at about a step a second)."""
PER_STEP = 128
"""Documents per step: 8 seeds × 16 episodes (the example's 512 learn; this checks the mechanics, faster)."""
STREAM_READ = 200
"""Documents read from the head of the stream (at most; those not yet trimmed)."""

_STREAM_HEAD = """
import json, os, redis
from rljob_wire.codec import decode_entry
r = redis.Redis(host=os.environ["HOST"], port=int(os.environ["PORT"]), password=os.environ.get("REDIS_PASSWORD"),
                socket_timeout=10)
k = json.loads(os.environ["KEYS"])
docs = []
for _, fields in r.xrange(k["stream"], count=%d):
    d = decode_entry(fields, require_metrics_fields=True, max_tokens=None)
    docs.append({"tokens": d.tokens.tolist(), "spans": [list(s) for s in d.loss_masking_spans],
                 "versions": d.model_version.tolist(), "logprobs": d.old_log_probabilities.tolist(),
                 "reward": d.reward, "advantage": d.advantage})
print(json.dumps(docs))
""" % STREAM_READ


def _job_manifest() -> dict:
    example = load_example("rljob-environment-cpu.yaml")
    spec = example["spec"]
    spec["trainer"]["maxSteps"] = MAX_STEPS
    spec["trainer"]["batch"]["documentsPerStep"] = PER_STEP
    spec["trainer"]["checkpoint"] = {"everySteps": 10, "keepLast": 1}  # no claim: the gang is never restarted here
    spec["rollout"]["promptsPerBatch"] = PER_STEP // spec["rollout"]["samplesPerPrompt"]
    spec["rollout"]["maxLag"] = 2 * PER_STEP
    spec["runPolicy"]["cleanPodPolicy"] = "None"
    return example


def _check_documents(documents: list[dict], tokenizer) -> int:
    """Issue 27 item 2's promises, on documents as the trainer reads them; returns the newest version they carry."""
    assert len(documents) >= 50, f"only {len(documents)} documents in the stream"
    turns = []
    for doc in documents:
        tokens, spans = doc["tokens"], [tuple(s) for s in doc["spans"]]
        assert tokenizer.decode(tokens[:spans[0][1]]) == "guess 0 to 9", doc
        assert secrets_replaying(tokens, spans, tokenizer), f"no game has these tokens: {doc}"
        masked = np.zeros(len(tokens), bool)
        for begin, end in spans:
            masked[begin:end] = True
        logprobs, versions = np.asarray(doc["logprobs"]), np.asarray(doc["versions"])
        assert (logprobs[masked] == 0).all() and (logprobs[~masked] < 0).all(), doc
        assert (np.diff(versions) >= 0).all(), doc
        for begin, end in spans[1:]:  # an answer carries the version of the turn sampled after it
            assert len(set(versions[begin:end + 1].tolist())) == 1, doc
        assert doc["reward"] in (0.0, 1.0), doc
        turns.append(len(spans))
    assert max(turns) >= 3 and np.mean(turns) >= 3, turns
    return max(max(doc["versions"]) for doc in documents)


@pytest.mark.timeout(900)
def test_episodes_on_an_operator_run_environment_through_scaling_and_its_pods_death(cluster, operator, namespace,
                                                                                      diagnostics):
    manifest = _job_manifest()
    name = manifest["metadata"]["name"]
    diagnostics.job = name
    env_name = f"{name}-environment"
    tokenizer = build_tokenizer(*(lambda s: (s.model, s.rollout.task))(RLTrainingJobSpec.model_validate(
        manifest["spec"])))

    def job() -> dict:
        return get_job(cluster, namespace, name)

    def step() -> int:
        return (job().get("status") or {}).get("step") or 0

    def pods(role: str) -> list[dict]:
        return [p for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}={role}")
                if not p["metadata"].get("deletionTimestamp")]

    def ready(pod: dict) -> bool:
        return any(s.get("ready") for s in pod.get("status", {}).get("containerStatuses", []))

    def rollout_hash() -> dict:
        return redis_snapshot(cluster, namespace, job(), diagnostics)["rollout"]

    def environment_drops(rollout: dict) -> int:
        return sum(int(v) for k, v in rollout.items() if k.startswith("reward_errors:") and "Environment" in k)

    cluster.apply(manifest, namespace)
    running = wait_for(lambda: phase(j := job()) == "Running" and j, 300, "the job to run", diagnostics)

    # 1. The environment as rendered, and ready.
    (deployment,) = [d for d in cluster.items("deployments", namespace) if d["metadata"]["name"] == env_name]
    assert cluster.get("service", env_name, "-n", namespace), "no Service for the environment"
    policy = cluster.get("networkpolicy", env_name, "-n", namespace)
    assert policy and policy["spec"]["policyTypes"] == ["Ingress", "Egress"], policy
    template = deployment["spec"]["template"]["spec"]
    assert template["automountServiceAccountToken"] is False
    (container,) = template["containers"]
    security = {**template.get("securityContext", {}), **container.get("securityContext", {})}
    assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True, security
    ready_env = wait_for(lambda: condition(j := job(), c.ConditionType.ENVIRONMENT_READY).get("status") == "True" and j,
                         180, "EnvironmentReady=True", diagnostics)
    assert condition(ready_env, c.ConditionType.ENVIRONMENT_READY)["reason"] == c.Reason.ENVIRONMENT_AVAILABLE.value
    trainers = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods("trainer")}
    (first_rollout,) = pods("rollout")
    assert len(trainers) == 2 and running["status"]["attempt"] == 0

    # 2. Documents as the trainer reads them.
    wait_for(lambda: step() >= 3 or None, 300, "step 3", diagnostics)
    # A checkpoint's commit trims the entries it covers: just after one (every 10 steps) the head may hold fewer than
    # _check_documents reads, until the rollouts write more.
    documents = wait_for(
        lambda: d if len(d := redis_snapshot(cluster, namespace, job(), diagnostics, script=_STREAM_HEAD)) >= 50 else None,
        120, "50 documents at the head of the stream", diagnostics)
    newest = _check_documents(documents, tokenizer)
    # status.modelVersion is the operator's last read of the trainer's progress: it catches up with the documents'
    # versions (weights the trainer published), never the other way round
    wait_for(lambda: (job()["status"].get("modelVersion") or 0) >= newest or None, 60,
             f"status.modelVersion to reach the documents' newest version {newest}", diagnostics)

    # 3. Two rollout replicas through /scale.
    cluster.kubectl("scale", "rljob", name, "-n", namespace, "--replicas=2")
    second = f"{name}-rollout-1"
    wait_for(lambda: any(p["metadata"]["name"] == second and ready(p) for p in pods("rollout")) or None, 300,
             f"{second} ready", diagnostics)
    loaded = re.compile(r"rollout: loaded weights of step (\d+)")
    wait_for(lambda: loaded.search(cluster.kubectl("logs", "-n", namespace, second, check=False).stdout) or None,
             300, f"{second} to load the trainer's weights", diagnostics)
    wait_for(lambda: (json.loads(rollout_hash().get("worker:1", "{}")).get("tokens_per_second") or 0) > 0 or None,
             300, f"{second} to generate", diagnostics)

    # 4. The environment pod killed: its episodes dropped and counted, the next pod serves.
    before = environment_drops(rollout_hash())
    (env_pod,) = pods(c.Role.ENVIRONMENT.value)
    step_killed = step()
    cluster.kubectl("delete", "pod", env_pod["metadata"]["name"], "-n", namespace, "--grace-period=0", "--force")
    wait_for(lambda: (ps := pods(c.Role.ENVIRONMENT.value)) and ps[0]["metadata"]["uid"] != env_pod["metadata"]["uid"]
             and ready(ps[0]) or None, 180, "the next environment pod ready", diagnostics)
    dropped = wait_for(lambda: (n := environment_drops(rollout_hash())) > before and n, 120,
                       "the killed environment's episodes counted", diagnostics)
    wait_for(lambda: step() >= step_killed + 3 or None, 300, "training to go on after the environment's death",
             diagnostics)

    # 5. Back to one rollout replica.
    cluster.kubectl("scale", "rljob", name, "-n", namespace, "--replicas=1")
    wait_for(lambda: [p["metadata"]["name"] for p in cluster.items("pods", namespace, f"{c.LABEL_ROLE}=rollout")]
             == [first_rollout["metadata"]["name"]] or None, 120, f"{second} gone", diagnostics)
    assert step() < MAX_STEPS, "the job finished before the scale-down: raise MAX_STEPS"

    final = wait_for(lambda: phase(j := job()) in ("Succeeded", "Failed") and j, 600, "the job to finish", diagnostics)
    status = final["status"]
    assert status["phase"] == "Succeeded", diagnostics()
    assert status["attempt"] == 0 and status["restarts"] == 0, status
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods("trainer")} == trainers
    assert [p["metadata"]["uid"] for p in pods("rollout")] == [first_rollout["metadata"]["uid"]]
    snapshot = redis_snapshot(cluster, namespace, final, diagnostics)
    check_trained_once(snapshot, status, MAX_STEPS * PER_STEP)
    rollout = snapshot["rollout"]
    assert environment_drops(rollout) >= dropped, rollout
    assert json.loads(rollout["worker:1"])["tokens_per_second"] > 0, rollout
    # Finished: the server is scaled to 0 whatever cleanPodPolicy says (its pods would hold their quota).
    wait_for(lambda: (cluster.get("deployment", env_name, "-n", namespace) or {}).get("spec", {}).get("replicas") == 0
             and not pods(c.Role.ENVIRONMENT.value) or None, 120, "the environment scaled to 0", diagnostics)
