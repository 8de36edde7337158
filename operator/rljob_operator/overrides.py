"""A role's ``podTemplate`` (:class:`~rljob_api.pod_template.PodTemplateOverride`) merged onto the pod rljob renders for
it (a Pod, or the managed Redis Deployment's pod template), and what rljob keeps for itself refused.

Precedence (docs/pod-templates.md), ``<c>`` being rljob's container of the role (trainer, rollout, redis):

- ``metadata.labels``, ``metadata.annotations``: added. Refused: a key under ``rljob.dev/``, and a label rljob sets on
  the pod (job name, role, hashes, replica index, attempt, ``app.kubernetes.io/managed-by``), and Kueue's queue name
  (it belongs on the job: on pods, Kueue's pod integration would queue each pod on its own).
- ``spec.serviceAccountName``, ``automountServiceAccountToken``, ``priorityClassName``, ``runtimeClassName``,
  ``schedulerName``, ``affinity``: set; the template wins (rljob renders ``automountServiceAccountToken: false`` and
  none of the others).
- ``spec.securityContext`` and ``containers[<c>].securityContext``: merged field by field over rljob's; the template's
  fields win.
- ``spec.volumes``, ``topologySpreadConstraints``, ``imagePullSecrets``, ``initContainers``: appended after rljob's.
  Refused: a volume named as one of rljob's; an init container named as rljob's container, declaring one of its
  ports (a pod's containers share its network), or with a restartPolicy other than Always (a native sidecar) or unset.
- ``spec.containers``: only ``<c>`` (extra regular containers are refused, :func:`rljob_api.rules.own_container_only`);
  its ``env``, ``envFrom`` and ``volumeMounts`` are appended after rljob's. Refused: an env name rljob sets on ``<c>``,
  a mountPath at or under one of rljob's mounts. Kubernetes gives env precedence over envFrom, so a key of an envFrom
  source never replaces rljob's env either.

Everything else (image, command, args, ports, resources, probes, nodeSelector, tolerations, restartPolicy, hostname)
has no field in the template's model: it is rljob's, or has a field of its own in ``spec.<role>``. The CRD knows the
other fields of a ``containers`` entry only to refuse them by CEL with that reason
(:func:`rljob_api.rules.cel_own_container_fields`).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, Optional

from rljob_api import constants as c, rules
from rljob_api.pod_template import PodTemplateOverride
from rljob_api.validation import SpecProblem, mount_collision

RESERVED_PREFIX = f"{c.GROUP}/"
"""Labels and annotations under this prefix are rljob's, on every pod."""
SET_FIELDS = ("serviceAccountName", "automountServiceAccountToken", "priorityClassName", "runtimeClassName",
              "schedulerName", "affinity")
"""Pod spec fields the template sets (it wins)."""
APPENDED_FIELDS = ("volumes", "topologySpreadConstraints", "imagePullSecrets", "initContainers")
"""Pod spec lists the template appends to."""
CONTAINER_APPENDED_FIELDS = ("env", "envFrom", "volumeMounts")
"""Lists of rljob's container the template appends to."""
SIDECAR_RESTART_POLICY = "Always"


class Refused(ValueError):
    """The template sets what rljob sets itself; ``problems`` name each field."""

    def __init__(self, problems: list[SpecProblem]):
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


def conflicts(template: Mapping[str, Any], override: PodTemplateOverride, container: str,
              field: str) -> list[SpecProblem]:
    """What of ``override`` (the value of ``field``, e.g. ``spec.trainer.podTemplate``) rljob sets itself in
    ``template`` (the pod as rljob renders it: ``{"metadata", "spec"}``), whose own container is ``container``; in
    field order."""
    meta, spec = template.get("metadata") or {}, template["spec"]
    own = next(c for c in spec["containers"] if c["name"] == container)
    problems = [*_metadata_conflicts(meta, override, field), *_volume_conflicts(spec, override, field),
                *_init_container_conflicts(spec, own, override, field)]
    for i, entry in enumerate(override.spec.containers):
        path = f"{field}.spec.containers[{i}]"
        if not rules.own_container_only(entry.name, container):
            problems.append(SpecProblem(f"{path}.name", f"{entry.name!r} {rules.extra_container_message(container)}"))
            continue
        problems += _container_conflicts(own, entry.env, entry.env_from, entry.volume_mounts, path)
    return problems


def _listing(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in values)


def _metadata_conflicts(meta: Mapping[str, Any], override: PodTemplateOverride, field: str) -> list[SpecProblem]:
    problems = []
    rljob_labels = sorted(meta.get("labels") or {})
    for key in override.metadata.labels:
        if key.startswith(RESERVED_PREFIX) or key in rljob_labels:
            problems.append(SpecProblem(f"{field}.metadata.labels", (
                f"{key!r} is rljob's: keys under {RESERVED_PREFIX} and the labels rljob sets on these pods "
                f"({_listing(rljob_labels)}) are refused; remove it")))
        elif key == c.LABEL_KUEUE_QUEUE_NAME:
            problems.append(SpecProblem(f"{field}.metadata.labels", (
                f"{key!r} on pods would make Kueue's pod integration queue each pod as a workload of its own; put it "
                "on the RLTrainingJob (one Workload for the whole job, docs/kueue.md) and remove it here")))
    rljob_annotations = sorted(meta.get("annotations") or {})
    for key in override.metadata.annotations:
        if key.startswith(RESERVED_PREFIX) or key in rljob_annotations:
            problems.append(SpecProblem(f"{field}.metadata.annotations", (
                f"{key!r} is rljob's: keys under {RESERVED_PREFIX} are refused; remove it")))
    return problems


def _volume_conflicts(spec: Mapping[str, Any], override: PodTemplateOverride, field: str) -> list[SpecProblem]:
    names = [v["name"] for v in spec.get("volumes") or []]
    return [SpecProblem(f"{field}.spec.volumes[{i}].name", (
        f"{volume.get('name')!r} is the name of one of rljob's volumes in these pods ({_listing(names)}): rename "
        "it, and the volumeMounts that use it"))
        for i, volume in enumerate(override.spec.volumes) if volume.get("name") in names]


def _init_container_conflicts(spec: Mapping[str, Any], own: Mapping[str, Any], override: PodTemplateOverride,
                              field: str) -> list[SpecProblem]:
    problems = []
    names = [c["name"] for c in spec["containers"]]
    ports = [p["containerPort"] for p in own.get("ports") or []]
    for i, init in enumerate(override.spec.init_containers):
        path = f"{field}.spec.initContainers[{i}]"
        if init.get("name") in names:
            problems.append(SpecProblem(f"{path}.name", f"{init.get('name')!r} is the name of rljob's container: "
                                                        "rename it"))
        policy = init.get("restartPolicy")
        if policy not in (None, SIDECAR_RESTART_POLICY):
            problems.append(SpecProblem(f"{path}.restartPolicy", (
                f"{policy!r}: an init container runs to completion before {own['name']} starts (restartPolicy "
                f"unset) or runs beside it as a native sidecar (restartPolicy: {SIDECAR_RESTART_POLICY})")))
        for j, port in enumerate(init.get("ports") or []):
            if port.get("containerPort") in ports:
                problems.append(SpecProblem(f"{path}.ports[{j}].containerPort", (
                    f"{port.get('containerPort')} is a port of rljob's {own['name']} container ({_listing(ports)}): "
                    "the containers of a pod share its network, so a sidecar must listen on another")))
    return problems


def _reserved_env(name: str, container: str) -> Optional[str]:
    """Why an env name (or an envFrom prefix) is rljob's or torchrun's in ``container``; None when it is free."""
    if name.startswith(c.RESERVED_ENV_PREFIX):
        return f"names under {c.RESERVED_ENV_PREFIX} are rljob's"
    if container == c.Role.TRAINER.value and (name in c.TORCHRUN_ENV or name.startswith(c.TORCHELASTIC_ENV_PREFIX)):
        return f"torchrun sets it for every rank ({_listing(c.TORCHRUN_ENV)}, {c.TORCHELASTIC_ENV_PREFIX}*)"
    return None


def _container_conflicts(own: Mapping[str, Any], env: list[dict[str, Any]], env_from: list[dict[str, Any]],
                         mounts: list[dict[str, Any]], path: str) -> list[SpecProblem]:
    problems = []
    rljob_env = [e["name"] for e in own.get("env") or []]
    for j, var in enumerate(env):
        name = str(var.get("name") or "")
        if name in rljob_env:
            problems.append(SpecProblem(f"{path}.env[{j}].name", (
                f"{name!r} is set by rljob in the {own['name']} container ({_listing(rljob_env)}): remove it")))
        elif (why := _reserved_env(name, own["name"])) is not None:
            problems.append(SpecProblem(f"{path}.env[{j}].name", f"{name!r}: {why}: rename it"))
    for j, source in enumerate(env_from):
        prefix = str(source.get("prefix") or "")
        if prefix and (why := _reserved_env(prefix, own["name"])) is not None:
            problems.append(SpecProblem(f"{path}.envFrom[{j}].prefix", (
                f"{prefix!r} would import names that are not the template's ({why}): choose another prefix")))
    rljob_paths = [m["mountPath"] for m in own.get("volumeMounts") or []]
    for j, mount in enumerate(mounts):
        collision = mount_collision(str(mount.get("mountPath") or ""), rljob_paths, own["name"])
        if collision:
            problems.append(SpecProblem(f"{path}.volumeMounts[{j}].mountPath",
                                        f"{mount.get('mountPath')!r} is {collision}: choose another"))
    return problems


def secret_names(override: Optional[PodTemplateOverride]) -> list[str]:
    """The Secrets ``override`` names (env valueFrom, envFrom, secret and projected volumes; of rljob's container and
    the init containers), in order, each once."""
    if override is None:
        return []
    spec = override.spec
    containers = [*({"env": e.env, "envFrom": e.env_from} for e in spec.containers), *spec.init_containers]
    found = [((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
             for entry in containers for var in entry.get("env") or []]
    found += [(source.get("secretRef") or {}).get("name") for entry in containers for source in entry.get("envFrom") or []]
    found += [(volume.get("secret") or {}).get("secretName") for volume in spec.volumes]
    found += [(source.get("secret") or {}).get("name") for volume in spec.volumes
              for source in (volume.get("projected") or {}).get("sources") or []]
    return list(dict.fromkeys(name for name in found if name))


def merge(template: dict[str, Any], override: Optional[PodTemplateOverride], container: str,
          field: str) -> dict[str, Any]:
    """``template`` (a rendered pod, or a Deployment's pod template: ``{"metadata", "spec"}``) with ``override`` merged
    onto it as the module docstring says; ``template`` itself when ``override`` is unset or empty (so that a job without
    one renders exactly as before the field existed).

    Raises:
        Refused: the override sets what rljob sets itself (:func:`conflicts`).
    """
    if override is None or override.is_empty():
        return template
    problems = conflicts(template, override, container, field)
    if problems:
        raise Refused(problems)
    data = override.model_dump(mode="json", by_alias=True)
    out = copy.deepcopy(template)
    meta = out.setdefault("metadata", {})
    for key in ("labels", "annotations"):
        if key in data.get("metadata", {}):
            meta[key] = {**(meta.get(key) or {}), **data["metadata"][key]}
    spec, wanted = out["spec"], data.get("spec", {})
    for key in SET_FIELDS:
        if key in wanted:
            spec[key] = wanted[key]
    for key in APPENDED_FIELDS:
        if key in wanted:
            spec[key] = [*(spec.get(key) or []), *wanted[key]]
    if "securityContext" in wanted:
        spec["securityContext"] = {**(spec.get("securityContext") or {}), **wanted["securityContext"]}
    own = next(c for c in spec["containers"] if c["name"] == container)
    for entry in wanted.get("containers", []):
        for key in CONTAINER_APPENDED_FIELDS:
            if key in entry:
                own[key] = [*(own.get(key) or []), *entry[key]]
        if "securityContext" in entry:
            own["securityContext"] = {**(own.get("securityContext") or {}), **entry["securityContext"]}
    return out
