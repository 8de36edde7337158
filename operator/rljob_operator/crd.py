"""The RLTrainingJob CustomResourceDefinition, generated from the pydantic models of :mod:`rljob_api`.

``python -m rljob_operator.crd > crds/rltrainingjobs.rljob.dev.yaml`` (or ``rljob crd``) writes the committed
file; a test regenerates it and compares bytes, so the CRD never drifts from the models.

The pydantic JSON schema is turned into a Kubernetes *structural* schema: ``$ref``s inlined, ``Optional``
unwrapped, JSON-Schema-2020 exclusive bounds turned into OpenAPI v3 booleans, titles dropped, a description
on every field (``kubectl explain``), defaults on nested objects so their own defaults apply (not on what the
user must give: ``spec`` and ``spec.model``), and the rules only CEL can express (``x-kubernetes-validations``) placed next to the fields they guard.

The one exception to "from the pydantic models": a field marked with :data:`~rljob_api.pod_template.KUBE_FIELD` (the
Kubernetes-typed fields of ``spec.<role>.podTemplate``) gets the schema Kubernetes gives it, vendored from the pinned
version's OpenAPI spec without nested descriptions (:mod:`.kube_schemas`, DESIGN §9); the Container properties a role's
``containers`` entry may not set keep only their type (:func:`refused_shape`). The vendored fields, and every field of
the models without nested objects, are written in YAML's flow style (one line per field, :class:`Flow`), which keeps
the file under :data:`MAX_CRD_BYTES`.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from rljob_api import constants as c, rules
from rljob_api.pod_template import KUBE_FIELD
from rljob_api.spec import RLTrainingJobSpec
from rljob_api.status import RLTrainingJobStatus

from rljob_operator import kube_schemas

MAX_CRD_BYTES = 250_000
"""Bound on the generated CRD file (a test checks it): client-side ``kubectl apply`` keeps the whole object in its
last-applied-configuration annotation, and annotations are limited to 256 KiB."""
POD_TEMPLATE_ROLES = {"trainer": c.Role.TRAINER.value, "rollout": c.Role.ROLLOUT.value, "redis": c.Role.REDIS.value}
"""``spec.<field>.podTemplate`` → the name of rljob's container in that role's pods."""


class Flow(dict):
    """A node written in YAML's flow style, on one line: a pod-template field typed by Kubernetes (the model's
    description, then Kubernetes' schema), a field without nested objects, an object's default."""


class Vendored(Flow):
    """A schema node vendored from Kubernetes (:mod:`.kube_schemas`): no description of its own, written in flow
    style."""

_QUANTITY = {
    "anyOf": [{"type": "integer"}, {"type": "string"}],
    "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
    "x-kubernetes-int-or-string": True,
}

#: Schemas of the fields the pydantic model keeps free-form (``dict[str, Any]``), by JSON property name: the
#: same shapes as core/v1 ResourceRequirements and Toleration, so the API server checks them.
FREE_FORM_SCHEMAS: dict[str, dict[str, Any]] = {
    "resources": {
        "type": "object",
        "properties": {
            "limits": {
                "type": "object",
                "description": "Maximum amount of each resource, e.g. {cpu: 2, memory: 8Gi, nvidia.com/gpu: 8}.",
                "additionalProperties": dict(_QUANTITY),
            },
            "requests": {
                "type": "object",
                "description": "Amount of each resource the scheduler reserves.",
                "additionalProperties": dict(_QUANTITY),
            },
        },
    },
    "tolerations": {
        "type": "array",
        "items": {
            "type": "object",
            "description": "A core/v1 Toleration.",
            "properties": {
                "key": {"type": "string", "description": "Taint key; empty with operator Exists matches all."},
                "operator": {
                    "type": "string",
                    "enum": ["Exists", "Equal"],
                    "description": "Exists or Equal (default Equal).",
                },
                "value": {"type": "string", "description": "Taint value matched with operator Equal."},
                "effect": {
                    "type": "string",
                    "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"],
                    "description": "Taint effect to match; empty matches all.",
                },
                "tolerationSeconds": {
                    "type": "integer",
                    "format": "int64",
                    "description": "How long a NoExecute taint is tolerated.",
                },
            },
        },
    },
}

# --- CEL rules (x-kubernetes-validations); their messages are asserted by tests against a real API server ----
# The rules the operator's spec check and the trainer's start check share are in rljob_api.rules. The trainer's
# topology has no rule of its own: an edit of a running job is a gang restart that reshards the last checkpoint
# (DESIGN §5), refused only where the new topology is (rules.CEL_TOPOLOGY and the rules beside it).
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Summary of the conditions."},
    {"name": "DP", "type": "integer", "jsonPath": ".status.dataParallelSize", "description": "Data-parallel size."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "description": "Optimizer steps done."},
    {"name": "Progress", "type": "integer", "jsonPath": ".status.progressPercentage",
     "description": "Percent of spec.trainer.maxSteps done."},
    {"name": "ETA", "type": "string", "jsonPath": ".status.estimatedRemainingTimeSummary",
     "description": "Time left at the step rate of the last 10 minutes (while Running)."},
    {
        "name": "ModelVersion",
        "type": "integer",
        "jsonPath": ".status.modelVersion",
        "description": "Trainer weights version (documents).",
    },
    {
        "name": "Reward",
        "type": "number",
        "jsonPath": ".status.reward",
        "description": "Mean rollout reward of the newest weights version (trainer-only jobs: of the samples the last "
                       "step trained).",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    # -o wide
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt", "priority": 1,
     "description": "Trainer gang attempt."},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "priority": 1,
     "description": "Gang restarts."},
    {"name": "Documents", "type": "integer", "jsonPath": ".status.documentsSeen", "priority": 1,
     "description": "Documents that entered the loss."},
    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.lastCheckpoint.step", "priority": 1,
     "description": "Step of the newest committed checkpoint (a gang restart goes on from it)."},
    {"name": "Staleness", "type": "number", "jsonPath": ".status.lastMetrics.staleness", "priority": 1,
     "description": "Mean staleness of the last step (documents)."},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.tokensPerSecond", "priority": 1,
     "description": "Trained tokens per second of the last step."},
]

_KEEP = ("description", "enum", "format", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems",
         "maxItems", "x-kubernetes-list-type", "x-kubernetes-list-map-keys")


class SchemaError(ValueError):
    """The pydantic schema has a shape this generator cannot express structurally (names the property)."""


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str, with_defaults: bool,
             optional: bool = False, required: bool = False) -> dict[str, Any]:
    """One pydantic JSON-schema node → one structural OpenAPI v3 node (see module docstring).

    A nested object with a default (neither ``optional`` nor ``required`` of the user) gets as default the object
    of its properties' defaults, so the API server fills the whole tree and CEL rules always see every defaulted
    field.
    """
    own_description = node.get("description")
    own_default = node.get("default")
    if KUBE_FIELD in node:
        return _kubernetes(node[KUBE_FIELD], own_description)
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        out = _convert(target, defs, path, with_defaults)
        if own_description:
            out["description"] = own_description
        if with_defaults and not optional and not required and "default" not in node and "properties" in out:
            out["default"] = object_default(out)
    elif "anyOf" in node:
        members = [m for m in node["anyOf"] if m.get("type") != "null"]
        if len(members) != 1:
            raise SchemaError(f"{path}: a union of {len(members)} non-null types has no structural schema")
        out = _convert({**members[0], **({"description": own_description} if own_description else {})},
                       defs, path, with_defaults, optional=True)
    else:
        out = _convert_plain(node, defs, path, with_defaults)
    if with_defaults and own_default is not None:
        out["default"] = own_default
    return out


def _convert_plain(node: dict[str, Any], defs: dict[str, Any], path: str, with_defaults: bool) -> dict[str, Any]:
    kind = node.get("type")
    out: dict[str, Any] = {"type": kind} if kind else {}
    if "enum" in node and not kind:
        out["type"] = "string"
    for key in _KEEP:
        if key in node:
            out[key] = node[key]
    for bound, flag in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node:
            out[flag] = node[bound]
            out[bound] = True
    if kind == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if props:
            out["properties"] = {
                name: _convert(sub, defs, f"{path}.{name}", with_defaults, required=name in node.get("required", ()))
                for name, sub in props.items()
            }
            if node.get("required"):
                out["required"] = list(node["required"])
        elif isinstance(extra, dict) and extra:
            out["additionalProperties"] = _convert(extra, defs, f"{path}.*", with_defaults)
        else:
            out = _free_form(path, out)
    elif kind == "array":
        items = node.get("items") or {}
        if items.get("type") == "object" and not items.get("properties") and not items.get("$ref"):
            out = _free_form(path, out)
        else:
            out["items"] = _convert(items, defs, f"{path}[]", with_defaults, required=True)  # an item has no default
    return out


def _kubernetes(field: str, description: str | None) -> Flow:
    """The vendored schema of Kubernetes ``field`` (e.g. ``PodSpec.affinity``) with the model's ``description``; its
    nested nodes :class:`Vendored`."""
    schema = kube_schemas.inline(field)
    out = Flow({"description": description} if description else {})
    for key, value in schema.items():
        if key == "properties":
            value = {name: _vendored(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            value = _vendored(value)
        out[key] = value
    return out


def _vendored(node: Any) -> Any:
    """``node`` with every dict in it a :class:`Vendored`."""
    if isinstance(node, dict):
        return Vendored({key: _vendored(value) for key, value in node.items()})
    return [_vendored(value) for value in node] if isinstance(node, list) else node


def _own_container_only(item: dict[str, Any], container: str) -> None:
    """Give an item of a role's ``podTemplate.spec.containers`` (the model's name, env, envFrom, volumeMounts,
    securityContext) every other property of Kubernetes' Container, vendored, and the CEL rules that refuse them and any
    name but ``container``: a sidecar listed there, or an image set on rljob's container, is then refused with the
    reason and the way out, where the API server would only say ``unknown field "...image"`` (it refuses unknown fields
    before CEL runs)."""
    kubernetes = kube_schemas.inline_type("Container")["properties"]
    others = [name for name in kubernetes if name not in item["properties"]]
    for name in others:
        item["properties"][name] = _vendored(refused_shape(kubernetes[name]))
    item["x-kubernetes-validations"] = [rules.cel_own_container_only(container),
                                        rules.cel_own_container_fields(container, others)]


def refused_shape(node: dict[str, Any]) -> dict[str, Any]:
    """Kubernetes' schema ``node`` of a Container property that rljob's ``containers`` entry may not set, reduced to
    what the CEL rule that refuses it needs: its type (CEL declares only typed properties; a wrong type is refused
    before CEL runs, as before), an object's content kept whole (``x-kubernetes-preserve-unknown-fields``), so that
    strict field validation reports no "unknown field" inside it before CEL can say why. Any value of it is refused,
    so nothing it lets through is ever stored."""
    out = {"type": node["type"]}
    if node["type"] == "object":
        out["x-kubernetes-preserve-unknown-fields"] = True
    elif node["type"] == "array":
        out["items"] = refused_shape(node["items"])
    return out


def _leaves_in_flow(node: dict[str, Any]) -> None:
    """Make every property of ``node``'s tree that holds no object schema (a scalar, a list of scalars, a map to
    scalars) a :class:`Flow` node: one line per field, rather than a line per keyword."""
    if isinstance(node.get("default"), dict):
        node["default"] = Flow(node["default"])
    for name, sub in (node.get("properties") or {}).items():
        if isinstance(sub, Flow):
            continue
        nested = [sub.get("items"), sub.get("additionalProperties")]
        if "properties" not in sub and not any(isinstance(n, dict) and "properties" in n for n in nested):
            node["properties"][name] = Flow(sub)
        else:
            _leaves_in_flow(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict) and not isinstance(node[key], Flow):
            _leaves_in_flow(node[key])


def object_default(schema: dict[str, Any]) -> dict[str, Any]:
    """The object made of the defaults of ``schema``'s properties (nested objects included)."""
    return {name: sub["default"] for name, sub in schema.get("properties", {}).items() if "default" in sub}


def _free_form(path: str, out: dict[str, Any]) -> dict[str, Any]:
    name = path.rsplit(".", 1)[-1]
    if name not in FREE_FORM_SCHEMAS:
        raise SchemaError(f"{path}: free-form field without a schema; add it to FREE_FORM_SCHEMAS")
    return {**FREE_FORM_SCHEMAS[name], **{k: v for k, v in out.items() if k == "description"}}


def model_schema(model: type[BaseModel], path: str, *, with_defaults: bool) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of ``model`` (camelCase names).

    Raises:
        SchemaError: a field has no structural form (a multi-type union, an unknown free-form field).
    """
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(schema, schema.get("$defs", {}), path, with_defaults)


SCALE = {"specReplicasPath": ".spec.rollout.replicas", "statusReplicasPath": ".status.rolloutReplicas",
         "labelSelectorPath": ".status.rolloutSelector"}
"""The /scale subresource scales the rollout replicas (``kubectl scale rljob``, an HPA, KEDA): never the trainer gang,
whose size is a topology (DESIGN §5 rule 4). status.replicas counts the rollout pods that exist and are not being
deleted; status.selector selects them (status.rolloutSelector, written by the operator)."""


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition as a dict (apiextensions.k8s.io/v1)."""
    spec = model_schema(RLTrainingJobSpec, "spec", with_defaults=True)  # required (model has no default)
    spec["x-kubernetes-validations"] = [rules.CEL_METRICS_ONE_STAGE]
    spec["properties"]["trainer"]["x-kubernetes-validations"] = [rules.CEL_TOPOLOGY, rules.CEL_DOCUMENTS_PER_STEP,
                                                                  rules.CEL_REPLICATE, rules.CEL_REDUCE_NEEDS_FSDP,
                                                                  rules.CEL_DECAY_NEEDS_STEPS]
    spec["properties"]["algorithm"]["x-kubernetes-validations"] = [rules.CEL_KL_ESTIMATOR_NEEDS_KL,
                                                                    rules.CEL_DUAL_CLIP_WITHOUT_IS,
                                                                    rules.CEL_EPSILONS_WITHOUT_IS]
    spec["properties"]["algorithm"]["properties"]["importanceSampling"]["x-kubernetes-validations"] = [
        rules.CEL_IS_CAP_NEEDS_ENABLED]
    spec["properties"]["trainer"]["properties"]["parallelism"]["x-kubernetes-validations"] = [
        rules.CEL_REPLICATE_NEEDS_FSDP]
    spec["properties"]["trainer"]["properties"]["optimizer"]["x-kubernetes-validations"] = [
        rules.CEL_MIN_LEARNING_RATE, rules.CEL_MIN_LEARNING_RATE_NEEDS_DECAY]
    for field, container in POD_TEMPLATE_ROLES.items():
        template = spec["properties"][field]["properties"]["podTemplate"]["properties"]["spec"]
        _own_container_only(template["properties"]["containers"]["items"], container)
    task = spec["properties"]["rollout"]["properties"]["task"]
    task["x-kubernetes-validations"] = [rules.CEL_REWARD_SOURCE_NEEDS_CUSTOM]
    task["properties"]["rewardSource"]["x-kubernetes-validations"] = [rules.CEL_ONE_REWARD_SOURCE,
                                                                      rules.CEL_REWARD_VOLUME_NEEDS_PATH]
    rollout = spec["properties"]["rollout"]
    rollout["x-kubernetes-validations"] = [rules.CEL_ENVIRONMENT_NEEDS_TASK, rules.CEL_TASK_NEEDS_ENVIRONMENT]
    rollout["properties"]["autoscaling"]["x-kubernetes-validations"] = [rules.CEL_AUTOSCALING_BOUNDS]
    environment = rollout["properties"]["environment"]
    environment["x-kubernetes-validations"] = [rules.CEL_ONE_ENVIRONMENT]
    environment["properties"]["python"]["properties"]["source"]["x-kubernetes-validations"] = [
        rules.cel_one_source("source"), rules.cel_volume_needs_path("source")]
    status = model_schema(RLTrainingJobStatus, "status", with_defaults=False)
    status["properties"]["conditions"].update(
        {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}
    )
    _leaves_in_flow(spec)
    _leaves_in_flow(status)
    root = {
        "type": "object",
        "description": "RLTrainingJob runs streaming RL post-training (GRPO/GSPO) of an LLM: a managed or external "
        "Redis stream, a data-parallel trainer gang (torchrun) and rollout workers.",
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "Versioned schema of this representation (rljob.dev/v1alpha1).",
            },
            "kind": {"type": "string", "description": "Always RLTrainingJob."},
            "metadata": {"type": "object"},  # the API server allows nothing else here
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": c.CRD_NAME},
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "listKind": f"{c.KIND}List",
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}, "scale": SCALE},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as the YAML text committed in ``crds/`` (deterministic: key order kept, no wrapping)."""
    header = ("# Generated by `python -m rljob_operator.crd` from rljob_api's pydantic models (podTemplate fields: from "
              "Kubernetes' OpenAPI spec, rljob_operator/kube_schemas.json). Do not edit.\n")
    return header + yaml.dump(crd(), Dumper=_Dumper, sort_keys=False, width=1 << 16, allow_unicode=True)


class _Dumper(yaml.SafeDumper):
    """SafeDumper writing :class:`Flow` nodes in flow style."""


_Dumper.add_multi_representer(
    Flow, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True))


def main() -> None:
    """Print the CRD YAML to stdout."""
    sys.stdout.write(crd_yaml())


if __name__ == "__main__":
    main()
