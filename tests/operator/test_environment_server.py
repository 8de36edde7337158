"""The environment server the operator runs for a job's rollouts (issue 27 items 1 and 4; rljob_operator.environment):
its children as objects, its replicas in each phase, its Kueue pod set, and EnvironmentReady from pod objects as the
kubelet writes them (through observe.pod_view)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from rljob_api import constants as c, names
from rljob_api.constants import ConditionType, Phase, Reason
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import admission, environment, gang, job_status, queueing, render, workload
from rljob_operator.observe import DeploymentView, pod_view

from operator_helpers import T0, kubelet_pod, make_job, rollout, trainer

SERVER = {"image": "ghcr.io/example/guess:1", "command": ["python", "-m"], "args": ["guess.server"], "port": 9000,
          "replicas": 2, "resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "1Gi"}},
          "env": [{"name": "LEVEL", "value": "3"}], "nodeSelector": {"pool": "cpu"},
          "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}
URL = "http://demo-environment.ns.svc.cluster.local:9000"


def env_job(server=None, labels=None, **rollout_fields):
    block = {"server": {**SERVER, **(server or {})}}
    return make_job(labels=labels, rollout={"task": {"name": "environment"}, "environment": block, **rollout_fields})


def children(job):
    config = render.job_config(job)
    server = environment.server_of(config)
    service, policy = environment.static_children(job, config)
    return environment.deployment(job, server, server.replicas), service, policy


# --- the children ------------------------------------------------------------------------------------------------
def test_the_deployment_runs_the_servers_fields_sandboxed_with_a_readiness_probe_on_its_port():
    deployment, _, _ = children(env_job())
    meta, spec = deployment["metadata"], deployment["spec"]
    assert (deployment["apiVersion"], deployment["kind"], meta["name"]) == ("apps/v1", "Deployment", "demo-environment")
    role = {c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "environment"}
    assert meta["labels"] == {**role, "app.kubernetes.io/managed-by": "rljob-operator"}
    assert spec["replicas"] == 2 and spec["selector"] == {"matchLabels": role}
    template = spec["template"]
    assert template["metadata"]["labels"] == meta["labels"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    # sandbox: non-root with a fixed uid, no token, no service links, the runtime's seccomp profile
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
    assert "serviceAccountName" not in pod and "hostNetwork" not in pod
    (container,) = pod["containers"]
    assert container == {
        "name": "environment",
        "image": "ghcr.io/example/guess:1",
        "command": ["python", "-m"],
        "args": ["guess.server"],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "LEVEL", "value": "3"}],
        "ports": [{"name": "http", "containerPort": 9000, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    assert pod["volumes"] == [{"name": "scratch", "emptyDir": {}}]


def test_the_images_own_entrypoint_runs_without_command_and_args_and_a_home_of_the_users_is_kept():
    deployment, _, _ = children(env_job({"command": [], "args": [], "env": [{"name": "HOME", "value": "/data"}]}))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container and "args" not in container
    assert container["env"] == [{"name": "HOME", "value": "/data"}]


def test_the_service_is_the_address_rollouts_use_and_the_network_policy_admits_only_the_jobs_rollout_pods():
    _, service, policy = children(env_job())
    assert (service["kind"], service["metadata"]["name"]) == ("Service", "demo-environment")
    assert service["spec"] == {"type": "ClusterIP", "selector": {c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "environment"},
                               "ports": [{"name": "http", "port": 9000, "targetPort": 9000, "protocol": "TCP"}]}
    assert names.environment_url("demo", "ns", 9000) == URL  # what the rollout workers dial: this Service, this port
    assert (policy["apiVersion"], policy["kind"], policy["metadata"]["name"]) == (
        "networking.k8s.io/v1", "NetworkPolicy", "demo-environment")
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "environment"}},
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "rollout"}}}],
                     "ports": [{"protocol": "TCP", "port": 9000}]}],
        "egress": [{"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}],
    }


@pytest.mark.parametrize("block", [{"url": "http://env.example:8000"},
                                   {"python": {"entrypoint": "guess:Guess"}}])
def test_an_external_or_in_process_environment_has_no_children(block):
    job = make_job(rollout={"task": {"name": "environment"}, "environment": block})
    config = render.job_config(job)
    assert environment.server_of(config) is None and environment.static_children(job, config) == []
    assert environment.static_children(make_job(), render.job_config(make_job())) == []


def test_an_edit_of_a_server_field_rolls_only_the_environment_pods():
    before, edited = env_job(), env_job({"image": "ghcr.io/example/guess:2", "replicas": 3, "env": []})
    hashes = [render.config_hashes(render.job_config(job)) for job in (before, edited)]
    assert (hashes[0].trainer, hashes[0].rollout) == (hashes[1].trainer, hashes[1].rollout)
    (old, *_), (new, *_) = children(before), children(edited)
    assert old["spec"]["template"] != new["spec"]["template"] and new["spec"]["replicas"] == 3


@pytest.mark.parametrize(("phase", "held", "count"), [
    (Phase.PENDING, False, 2), (Phase.STARTING, False, 2), (Phase.RUNNING, False, 2), (Phase.RESTARTING, False, 2),
    (Phase.PENDING, True, 0), (Phase.SUSPENDED, False, 0), (Phase.SUCCEEDED, False, 0), (Phase.FAILED, False, 0),
    (Phase.INVALID, False, 0),
])
def test_the_server_runs_while_the_job_runs_or_starts_and_no_pod_while_it_is_held_suspended_or_finished(
        phase, held, count):
    server = environment.server_of(render.job_config(env_job()))
    assert environment.replicas(server, phase, held) == count


def test_a_refused_deployment_names_the_servers_field():
    message = ('Deployment.apps "demo-environment" is invalid: spec.template.spec.containers[0].resources.requests: '
               'Invalid value: "-1": must be greater than or equal to 0')
    assert admission.refused_field(message) == "spec.rollout.environment.server.resources"
    assert admission.refused_field('Deployment.apps "demo-environment" is invalid: metadata.name: bad') == (
        "spec.rollout.environment.server")


# --- Kueue -------------------------------------------------------------------------------------------------------
def test_the_workload_counts_the_environment_pods_as_a_pod_set_stripped_like_the_others():
    job = env_job(labels={c.LABEL_KUEUE_QUEUE_NAME: "team-a"})
    wl = queueing.wanted(job, render.job_config(job), None)
    sets = {s["name"]: s for s in wl["spec"]["podSets"]}
    assert list(sets) == ["trainer", "rollout", "environment"]
    assert sets["environment"] == {"name": "environment", "count": 2, "template": {"spec": {
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{"name": "environment", "resources": {"requests": {"cpu": "500m"}, "limits": {"memory": "1Gi"}}}],
    }}}

    def wanted(job):
        return queueing.wanted(job, render.job_config(job), None)
    # replicas and resources are counted (an edit queues the job anew); the image, command and env are not
    assert workload.outdated(wl, wanted(env_job({"replicas": 3}, labels={c.LABEL_KUEUE_QUEUE_NAME: "team-a"})))
    assert not workload.outdated(wl, wanted(env_job({"image": "other:2", "args": [], "env": []},
                                                    labels={c.LABEL_KUEUE_QUEUE_NAME: "team-a"})))
    # a job without an environment server keeps the two pod sets it always had
    plain = make_job(labels={c.LABEL_KUEUE_QUEUE_NAME: "team-a"})
    assert [s["name"] for s in wanted(plain)["spec"]["podSets"]] == ["trainer", "rollout"]


def test_an_admitted_environment_pod_set_places_the_deployments_pod_template():
    decided = workload.Decision(None, assignments={"environment": ({"pool": "cpu", "zone": "a"}, (
        {"key": "flavor", "operator": "Exists", "effect": "NoSchedule"},))})
    job = env_job()
    server = environment.server_of(render.job_config(job))
    template = workload.admitted_pod(environment.pod_template(job, server), "environment", decided)
    placed = environment.deployment(job, server, 2, template)["spec"]["template"]["spec"]
    assert placed["nodeSelector"] == {"pool": "cpu", "zone": "a"}
    assert placed["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"},
                                     {"key": "flavor", "operator": "Exists", "effect": "NoSchedule"}]


# --- EnvironmentReady --------------------------------------------------------------------------------------------
RUNNING = gang.Lifecycle(phase=Phase.RUNNING, gang_created=True, start_time=T0, reason=Reason.TRAINING,
                         message="attempt 0: all 2 trainer pods running")
READY = job_status.RedisHealth(True, "managed Redis demo-redis: 1/1 replicas available")
SERVER_SPEC = environment.server_of(render.job_config(env_job()))
WORKERS = [trainer(0, 0), trainer(1, 0), rollout(0)]


def env_pod(index, phase="Running", **container):
    """An environment server pod as the kubelet writes it (its ReplicaSet's name suffix stands in for the hash)."""
    pod = kubelet_pod("environment", index, phase, **container)
    pod["metadata"]["name"] = f"demo-environment-7f9c-{index}"
    pod["metadata"]["labels"] = {c.LABEL_JOB_NAME: "demo", c.LABEL_ROLE: "environment"}
    return pod_view(pod)


def deployment_view(available: int, wanted: int = 2):
    ok = available >= wanted
    return DeploymentView("demo-environment", ok, f"{available}/{wanted} replicas available", "uid", wanted)


def build(previous, pods, deployment=None, lifecycle=RUNNING, seconds=0.0, count=2, spec=None):
    block = spec if spec is not None else env_job().spec.rollout.environment
    return job_status.build_status(
        previous, generation=1, lifecycle=lifecycle, problems=[], data_parallel_size=2, redis=READY,
        pods=WORKERS + list(pods), nodes=2, replicas=1, progress=None, now=T0 + timedelta(seconds=seconds),
        environment=environment.report(env_job(), block, deployment, count))


def stamp(seconds):
    return (T0 + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def not_ready(status, reason):
    """EnvironmentReady of ``status``, asserted False with ``reason``: its message after the server's name and URL."""
    ready = status.condition(ConditionType.ENVIRONMENT_READY)
    assert (ready.status, ready.reason) == ("False", reason)
    prefix = f"environment server demo-environment ({URL}): "
    assert ready.message.startswith(prefix)
    return ready.message[len(prefix):]


def test_environment_ready_is_true_once_every_replica_is_available_and_sits_after_rollout_ready():
    up = [env_pod(i, state={"running": {"startedAt": stamp(0)}}) for i in range(2)]
    status = build(RLTrainingJobStatus(), up, deployment_view(2))
    ready = status.condition(ConditionType.ENVIRONMENT_READY)
    assert (ready.status, ready.reason, ready.message) == (
        "True", "EnvironmentAvailable", f"environment server demo-environment ({URL}): 2/2 replicas available")
    assert [cond.type.value for cond in status.conditions] == [
        "Valid", "RedisReady", "RolloutReady", "EnvironmentReady", "TrainerReady", "Running"]
    assert status.condition(ConditionType.RUNNING).message == RUNNING.message


def test_an_image_that_cannot_be_pulled_names_the_field_and_the_image_with_a_warning():
    pulling = [env_pod(i, phase="Pending", state={"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/example/guess:1"'}}) for i in range(2)]
    first = build(RLTrainingJobStatus(), [], deployment_view(0))
    status = build(first, pulling, deployment_view(0), seconds=5)
    assert not_ready(status, "ContainerCannotStart") == (
        "0/2 environment pods ready; cannot start: demo-environment-7f9c-0, demo-environment-7f9c-1: spec.rollout.environment.server.image "
        "'ghcr.io/example/guess:1' cannot be pulled: container environment ImagePullBackOff: "
        'Back-off pulling image "ghcr.io/example/guess:1"')
    events = job_status.transition_events(first, status)
    assert [(e.type, e.reason) for e in events] == [("Warning", "ContainerCannotStart")]
    # Running does not wait for it, and says that no new document reaches the trainer meanwhile
    running = status.condition(ConditionType.RUNNING)
    assert (running.status, running.message) == ("True", (
        "attempt 0: all 2 trainer pods running; no new document reaches the trainer while EnvironmentReady is False "
        "(ContainerCannotStart)"))


def test_a_crash_loop_quotes_the_servers_last_termination_message():
    last = {"terminated": {"exitCode": 1, "reason": "Error", "startedAt": stamp(-20), "finishedAt": stamp(-19),
                           "message": "Traceback (most recent call last):\nModuleNotFoundError: No module named "
                                      "'guess'\n"}}
    looping = [env_pod(0, restartCount=3, lastState=last, state={"waiting": {
        "reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}}),
        env_pod(1, state={"running": {"startedAt": stamp(0)}})]
    status = build(RLTrainingJobStatus(), looping, deployment_view(1))
    assert not_ready(status, "ContainerFailing") == (
        "1/2 environment pods ready; failing: demo-environment-7f9c-0: "
        "container environment CrashLoopBackOff, 3 restarts; last run: exit code 1 (Error): ModuleNotFoundError: "
        "No module named 'guess'")
    # one replica serves: episodes go on, Running says nothing of a starved trainer
    assert status.condition(ConditionType.RUNNING).message == RUNNING.message


def test_a_server_that_runs_but_never_answers_on_its_port_names_the_port_after_a_grace():
    silent = [replace(env_pod(0, state={"running": {"startedAt": stamp(0)}}), ready=False)]
    young = build(RLTrainingJobStatus(), silent, deployment_view(0, 1), seconds=10, count=1)
    assert young.condition(ConditionType.ENVIRONMENT_READY).reason == "PodsNotReady"
    old = build(young, silent, deployment_view(0, 1), seconds=45, count=1)
    assert not_ready(old, "ReadinessFailing") == (
        "0/1 environment pods ready; not ready: demo-environment-7f9c-0: "
        "spec.rollout.environment.server.port 9000: container environment has run for 45 s but nothing answers its "
        "readiness probe (a TCP connection to port 9000); the server must listen on 0.0.0.0:9000")
    assert [(e.type, e.reason) for e in job_status.transition_events(young, old)] == [("Warning", "ReadinessFailing")]


def test_environment_ready_follows_the_phase_while_the_server_runs_no_pod_and_goes_with_the_environment():
    up = build(RLTrainingJobStatus(), [], deployment_view(2))
    suspended = gang.Lifecycle(phase=Phase.SUSPENDED, reason=Reason.JOB_SUSPENDED, message="suspended")
    down = build(up, [], deployment_view(0, 0), lifecycle=suspended, count=0)
    ready = down.condition(ConditionType.ENVIRONMENT_READY)
    assert (ready.status, ready.reason, ready.message) == ("False", "JobSuspended", "suspended")
    held = gang.Lifecycle(phase=Phase.PENDING, reason=Reason.WAITING_FOR_ADMISSION, message="waiting for Kueue")
    assert build(up, [], deployment_view(0, 0), lifecycle=held, count=0).condition(
        ConditionType.ENVIRONMENT_READY).reason == "WaitingForAdmission"
    # an edit that removes the environment removes the condition (other conditions stay listed once set)
    gone = job_status.build_status(up, generation=2, lifecycle=RUNNING, problems=[], data_parallel_size=2,
                                   redis=READY, pods=WORKERS, nodes=2, replicas=1, progress=None, now=T0)
    assert gone.condition(ConditionType.ENVIRONMENT_READY) is None
    # a job without an environment never has it
    plain = job_status.build_status(RLTrainingJobStatus(), generation=1, lifecycle=RUNNING, problems=[],
                                    data_parallel_size=2, redis=READY, pods=WORKERS, nodes=2, replicas=1,
                                    progress=None, now=T0)
    assert ConditionType.ENVIRONMENT_READY not in [cond.type for cond in plain.conditions]


def test_an_external_url_is_unknown_and_an_in_process_environment_has_no_condition():
    url = make_job(rollout={"task": {"name": "environment"},
                            "environment": {"url": "http://env.example:8000"}}).spec.rollout.environment
    ready = build(RLTrainingJobStatus(), [], spec=url).condition(ConditionType.ENVIRONMENT_READY)
    assert (ready.status, ready.reason) == ("Unknown", "ExternalEnvironment")
    assert ready.message.startswith("spec.rollout.environment.url http://env.example:8000 is a server outside the "
                                    "job, which the operator does not probe")
    python = make_job(rollout={"task": {"name": "environment"},
                               "environment": {"python": {"entrypoint": "guess:Guess"}}}).spec.rollout.environment
    assert environment.report(env_job(), python, None, 0) is None


def test_an_environment_pod_that_fails_or_is_deleted_restarts_neither_the_gang_nor_a_rollout_pod():
    job = env_job()
    hashes = render.config_hashes(render.job_config(job))
    workers = [trainer(i, 0, config_hash=hashes.config, role_config_hash=hashes.trainer) for i in range(2)]
    workers.append(rollout(0, config_hash=hashes.config, role_config_hash=hashes.rollout))
    crashed = env_pod(0, phase="Failed", state={"terminated": {"exitCode": 1, "reason": "Error"}})
    deleted = replace(env_pod(1, state={"running": {"startedAt": stamp(0)}}), deleting=True)
    plan = gang.plan("demo", job.spec, RUNNING, workers + [crashed, deleted], hashes, T0)
    assert plan == gang.plan("demo", job.spec, RUNNING, workers, hashes, T0)  # as if they were not there
    assert (plan.lifecycle.attempt, plan.lifecycle.restarts) == (0, 0) and plan.lifecycle.phase != Phase.RESTARTING
    assert plan.delete == () and plan.create_trainers == () and plan.create_rollouts == ()
