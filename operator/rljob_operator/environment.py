"""Pure: the environment server the operator runs for a job's rollouts (``spec.rollout.environment.server``) — its
children, its share of the job's Kueue Workload, and how many replicas it runs in each phase.

Children of a job ``J`` with a server (names from :func:`rljob_api.names.environment`), owned like every other child
(the garbage collector removes them with the job, and with it a TTL):

- Deployment ``J-environment``: ``server.replicas`` pods of ``server.image`` (its ``command``/``args`` when set, the
  image's otherwise), restartPolicy Always, so a crashed server restarts on its own and nothing else does (neither the
  trainer gang nor the rollout pods: the gang's plan reads trainer and rollout pods only). An edit of a server field
  changes the pod template alone and rolls the environment pods (the rollout pods keep running: their role hash
  leaves the server's pod fields out). Rendered from the resolved config the job runs, like the managed Redis.
- Service ``J-environment`` (ClusterIP) on ``server.port``: the rollout workers reach it at
  :func:`rljob_api.names.environment_url`.
- NetworkPolicy ``J-environment``: ingress to the environment pods only from the job's own rollout pods, on
  ``server.port``; egress denied but DNS (UDP and TCP 53). Enforced only by a CNI plugin that implements NetworkPolicy
  (Calico, Cilium, ...); elsewhere the API server stores it and nothing enforces it.

The pods are sandboxed (:func:`pod_template`): non-root with a fixed uid (:data:`UID`), read-only root filesystem
with an emptyDir at ``/tmp`` (:data:`SCRATCH_DIR`, also ``HOME``), no service-account token, no privilege
escalation, every capability dropped, the runtime's default seccomp profile.

Replicas (:func:`replicas`): ``server.replicas`` while the job runs or waits to start; 0 while Kueue holds it (not
admitted, evicted), while it is suspended or invalid, and once it has finished — whatever ``cleanPodPolicy`` says, which
is about the job's own trainer and rollout pods: a server left running would hold its resources (and, under Kueue,
quota the finished Workload no longer counts) until the job is deleted.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from rljob_api import constants as c
from rljob_api import names
from rljob_api.config import JobConfig
from rljob_api.constants import Phase
from rljob_api.spec import EnvironmentServerSpec, EnvironmentSpec

from rljob_operator import render
from rljob_operator.job_status import EnvironmentReport
from rljob_operator.observe import DeploymentView

UID = 65532
"""The uid (and gid, fsGroup) environment server containers run as: not root, the ``nonroot`` user of distroless
images; the image's own USER is overridden so that ``runAsNonRoot`` holds for every image."""
SCRATCH_DIR = "/tmp"
"""The one writable directory of an environment container (an emptyDir): its root filesystem is read-only. ``HOME``
points here unless ``server.env`` sets it."""
SCRATCH_VOLUME = "scratch"
PORT_NAME = "http"
READINESS_PERIOD_S = 5
"""Seconds between readiness probes (a TCP connection to ``server.port``)."""
REVISION_HISTORY = 2
"""Old ReplicaSets a Deployment keeps after server edits (Kubernetes' default is 10)."""
FIELD = "spec.rollout.environment.server"
"""Where the server's fields live in the spec (what conditions and refusals name)."""
STOPPED_PHASES = (Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED, Phase.INVALID)
"""Phases in which the environment server runs no pod."""


def server_of(config: JobConfig) -> Optional[EnvironmentServerSpec]:
    """The environment server ``config`` runs, or None (no environment, or an external ``url`` or ``python`` one)."""
    environment = config.spec.rollout.environment
    return environment.server if environment is not None else None


def replicas(server: EnvironmentServerSpec, phase: Phase, held: bool) -> int:
    """The Deployment's replicas for a job in ``phase`` (``held``: Kueue holds it): see the module docstring."""
    return 0 if held or phase in STOPPED_PHASES else server.replicas


def pod_template(job: render.Job, server: EnvironmentServerSpec) -> dict[str, Any]:
    """The environment pods' template (labels: the job's name and role ``environment``); sandboxed as the module
    docstring says."""
    env = [dict(var) for var in server.env]
    if not any(var.get("name") == "HOME" for var in env):
        env.insert(0, {"name": "HOME", "value": SCRATCH_DIR})
    container: dict[str, Any] = {
        "name": c.Role.ENVIRONMENT.value,
        "image": server.image,
        "env": env,
        "ports": [{"name": PORT_NAME, "containerPort": server.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": server.port}, "periodSeconds": READINESS_PERIOD_S},
        "resources": {key: dict(value) for key, value in server.resources.items()},
        "volumeMounts": [{"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}],
        "terminationMessagePolicy": render.TERMINATION_MESSAGE_POLICY,
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if server.command:
        container["command"] = list(server.command)
    if server.args:
        container["args"] = list(server.args)
    spec: dict[str, Any] = {
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [{"name": SCRATCH_VOLUME, "emptyDir": {}}],
    }
    if server.node_selector:
        spec["nodeSelector"] = dict(server.node_selector)
    if server.tolerations:
        spec["tolerations"] = [dict(t) for t in server.tolerations]
    return {"metadata": {"labels": render.labels(job, c.Role.ENVIRONMENT)}, "spec": spec}


def deployment(job: render.Job, server: EnvironmentServerSpec, count: int,
               template: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The Deployment ``<job>-environment`` running ``count`` pods of ``template`` (default: :func:`pod_template`; a
    queued job passes it placed by Kueue's admission)."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": render.child_meta(names.environment(job.name), job, c.Role.ENVIRONMENT),
        "spec": {
            "replicas": count,
            "revisionHistoryLimit": REVISION_HISTORY,
            "selector": {"matchLabels": render.selector(job, c.Role.ENVIRONMENT)},
            "template": dict(template) if template is not None else pod_template(job, server),
        },
    }


def service(job: render.Job, server: EnvironmentServerSpec) -> dict[str, Any]:
    """The ClusterIP Service ``<job>-environment`` on ``server.port`` (what :func:`rljob_api.names.environment_url`
    names)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": render.child_meta(names.environment(job.name), job, c.Role.ENVIRONMENT),
        "spec": {
            "type": "ClusterIP",
            "selector": render.selector(job, c.Role.ENVIRONMENT),
            "ports": [{"name": PORT_NAME, "port": server.port, "targetPort": server.port, "protocol": "TCP"}],
        },
    }


DNS_PORT = 53


def network_policy(job: render.Job, server: EnvironmentServerSpec) -> dict[str, Any]:
    """The NetworkPolicy ``<job>-environment``: the environment pods accept connections only from the job's rollout
    pods on ``server.port`` and open none but DNS queries (UDP and TCP port 53, to any address: cluster DNS may be a
    node-local cache)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": render.child_meta(names.environment(job.name), job, c.Role.ENVIRONMENT),
        "spec": {
            "podSelector": {"matchLabels": render.selector(job, c.Role.ENVIRONMENT)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [{"podSelector": {"matchLabels": render.selector(job, c.Role.ROLLOUT)}}],
                "ports": [{"protocol": "TCP", "port": server.port}],
            }],
            "egress": [{"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]}],
        },
    }


def static_children(job: render.Job, config: JobConfig) -> list[dict[str, Any]]:
    """The environment's children that do not depend on the job's phase (Service, NetworkPolicy); none without a
    server. The Deployment, whose replicas do, is applied after the pass's plan."""
    server = server_of(config)
    return [] if server is None else [service(job, server), network_policy(job, server)]


KINDS = (("apps/v1", "Deployment"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"))
"""(apiVersion, kind) of the environment's children, all named :func:`rljob_api.names.environment`."""


def report(job: render.Job, spec: Optional[EnvironmentSpec], deployment: Optional[DeploymentView],
           count: int) -> Optional[EnvironmentReport]:
    """What EnvironmentReady of ``job`` is made of (:class:`~rljob_operator.job_status.EnvironmentReport`): its
    environment ``spec`` (``spec.rollout.environment``), the server's ``deployment`` as observed and the ``count`` of
    pods it should run now; None when the job's rollouts step no server (no environment, or an in-process
    ``python`` one): no EnvironmentReady then."""
    if spec is None or (spec.server is None and spec.url is None):
        return None
    if spec.server is None:
        return EnvironmentReport(url=spec.url or "")
    return EnvironmentReport(url=names.environment_url(job.name, job.namespace, spec.server.port), server=spec.server,
                             name=names.environment(job.name), deployment=deployment, replicas=count)
