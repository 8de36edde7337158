"""The generated CRD: committed bytes, descriptions, defaults, enums, bounds, CEL rules, columns, the Kubernetes schemas
of the pod templates and the file's size."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from rljob_api import rules
from rljob_operator import crd, kube_schemas

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / "rltrainingjobs.rljob.dev.yaml"
CHART_COPY = ROOT / "helm" / "rljob-operator" / "crds" / "rltrainingjobs.rljob.dev.yaml"


def _schema() -> dict:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict, path: str):
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_committed_crd_matches_the_models_byte_for_byte():
    assert COMMITTED.read_text() == crd.crd_yaml(), "run: python -m rljob_operator.crd > crds/rltrainingjobs.rljob.dev.yaml"


def test_chart_carries_the_same_crd():
    assert CHART_COPY.read_bytes() == COMMITTED.read_bytes(), "copy crds/ into helm/rljob-operator/crds/"


def test_every_field_has_a_description_and_a_type():
    """Kubernetes' own schemas under podTemplate (:class:`crd.Vendored`) go without descriptions, as kubebuilder's
    maxDescLen=0 writes them; the podTemplate fields themselves are described."""
    missing = []
    for path, node in _walk(_schema(), "root"):
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), path
        if path in ("root.metadata",) or path.endswith(".*") or isinstance(node, crd.Vendored):
            continue  # the API server forbids anything but a type on metadata; map values describe nothing
        if not node.get("description"):
            missing.append(path)
    assert missing == []


def test_descriptions_start_with_what_the_field_does_not_with_its_name():
    """``kubectl explain`` prints the field's name already."""
    named = []
    for path, node in _walk(_schema(), "root"):
        name = path.rsplit(".", 1)[-1].rstrip("[]")
        if (node.get("description") or "").lower().startswith((f"{name.lower()}:", f"{name.lower()} (")):
            named.append(path)
    assert named == []
    backend = _schema()["properties"]["spec"]["properties"]["trainer"]["properties"]["backend"]
    assert backend["enum"] == ["builtin"]  # a Fast-LLM trainer is refused by the schema itself


def test_schema_is_structural_no_refs_unions_or_unknown_field_passthrough():
    text = crd.crd_yaml()
    for forbidden in ("$ref", "anyOf: [{type: null", "type: 'null'", "title:", "allOf", "oneOf", "x-kubernetes-patch",
                      "int-or-string\n"):
        assert forbidden not in text
    assert yaml.safe_load(text) == crd.crd()  # the flow-style parts read back as the same schema
    passthrough = []
    for path, node in _walk(_schema(), "root"):
        assert not ("properties" in node and "additionalProperties" in node)
        if "x-kubernetes-preserve-unknown-fields" in node:
            passthrough.append(path)
    # only inside the Container properties a role's containers entry may not set: a CEL rule refuses any value of them
    # (test_pod_template_fields_carry_kubernetes_schemas_without_nested_descriptions), so nothing unchecked is stored
    refused = ("lifecycle", "livenessProbe", "ports[]", "readinessProbe", "resizePolicy[]", "resources",
               "restartPolicyRules[]", "startupProbe", "volumeDevices[]")
    assert sorted(passthrough) == sorted(f"root.spec.{field}.podTemplate.spec.containers[].{name}"
                                         for field in crd.POD_TEMPLATE_ROLES for name in refused)
    assert text.count("x-kubernetes-preserve-unknown-fields") == len(passthrough)


def test_defaults_enums_and_bounds_come_from_the_models():
    spec = _schema()["properties"]["spec"]
    trainer = spec["properties"]["trainer"]
    assert trainer["properties"]["nodes"] == {
        "type": "integer", "description": trainer["properties"]["nodes"]["description"],
        "minimum": 1, "maximum": 4096, "default": 1,
    }
    assert spec["properties"]["algorithm"]["properties"]["loss"]["enum"] == ["grpo", "gspo"]
    assert spec["properties"]["runPolicy"]["properties"]["cleanPodPolicy"]["enum"] == ["All", "Running", "None"]
    eps = spec["properties"]["algorithm"]["properties"]["epsilonLow"]
    assert (eps["minimum"], eps["exclusiveMinimum"], eps["maximum"], eps["exclusiveMaximum"]) == (0, True, 1, True)
    assert "default" not in eps  # Optional: resolved by the loss
    # nested objects default to the tree of their defaults, so CEL always sees every field
    assert trainer["default"]["nodes"] == 1 and trainer["default"]["batch"]["documentsPerStep"] == 128
    assert spec["properties"]["runPolicy"]["default"]["suspend"] is False
    # what the user must give has no default: no silent tiny model
    assert "default" not in spec and _schema()["required"] == ["spec"] and spec["required"] == ["model"]
    model = spec["properties"]["model"]
    assert "default" not in model and model["required"] == ["source"] and "default" not in model["properties"]["name"]
    assert "default" not in spec["properties"]["hfTokenSecretRef"]  # optional objects stay absent
    assert spec["properties"]["hfTokenSecretRef"]["required"] == ["name", "key"]


def test_free_form_fields_get_kubernetes_schemas():
    trainer = _schema()["properties"]["spec"]["properties"]["trainer"]["properties"]
    limits = trainer["resources"]["properties"]["limits"]["additionalProperties"]
    assert limits["x-kubernetes-int-or-string"] is True
    toleration = trainer["tolerations"]["items"]["properties"]
    assert toleration["operator"]["enum"] == ["Exists", "Equal"]
    assert toleration["effect"]["enum"] == ["NoSchedule", "PreferNoSchedule", "NoExecute"]


def test_cel_rules_sit_next_to_their_fields():
    spec = _schema()["properties"]["spec"]
    trainer = spec["properties"]["trainer"]
    assert trainer["x-kubernetes-validations"] == [
        rules.CEL_TOPOLOGY, rules.CEL_DOCUMENTS_PER_STEP, rules.CEL_REPLICATE, rules.CEL_REDUCE_NEEDS_FSDP,
        rules.CEL_DECAY_NEEDS_STEPS]
    algorithm = spec["properties"]["algorithm"]
    assert algorithm["x-kubernetes-validations"] == [
        rules.CEL_KL_ESTIMATOR_NEEDS_KL, rules.CEL_DUAL_CLIP_WITHOUT_IS, rules.CEL_EPSILONS_WITHOUT_IS]
    assert algorithm["properties"]["importanceSampling"]["x-kubernetes-validations"] == [rules.CEL_IS_CAP_NEEDS_ENABLED]
    assert trainer["properties"]["parallelism"]["x-kubernetes-validations"] == [rules.CEL_REPLICATE_NEEDS_FSDP]
    assert trainer["properties"]["optimizer"]["x-kubernetes-validations"] == [
        rules.CEL_MIN_LEARNING_RATE, rules.CEL_MIN_LEARNING_RATE_NEEDS_DECAY]
    assert spec["x-kubernetes-validations"] == [rules.CEL_METRICS_ONE_STAGE]  # the topology may change (a restart)
    assert rules.CEL_TOPOLOGY["rule"].endswith(
        "|| (self.nodes * self.processesPerNode) % (self.tensorParallel * self.pipelineParallel) == 0"
    )
    assert rules.CEL_METRICS_ONE_STAGE["rule"] == (
        "!(self.algorithm.metrics in ['basic', 'full']) || self.trainer.pipelineParallel == 1"
    )
    assert "oldSelf" not in json.dumps(crd.crd())  # no transition rule: every edit is checked as the spec it makes


def test_status_subresource_columns_and_names():
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    columns = [(col["name"], col["jsonPath"], col.get("priority", 0)) for col in version["additionalPrinterColumns"]]
    assert columns == [
        ("Phase", ".status.phase", 0),
        ("DP", ".status.dataParallelSize", 0),
        ("Step", ".status.step", 0),
        ("Progress", ".status.progressPercentage", 0),
        ("ETA", ".status.estimatedRemainingTimeSummary", 0),
        ("ModelVersion", ".status.modelVersion", 0),
        ("Reward", ".status.reward", 0),
        ("Age", ".metadata.creationTimestamp", 0),
        ("Attempt", ".status.attempt", 1),  # -o wide
        ("Restarts", ".status.restarts", 1),
        ("Documents", ".status.documentsSeen", 1),
        ("Checkpoint", ".status.lastCheckpoint.step", 1),
        ("Staleness", ".status.lastMetrics.staleness", 1),
        ("Tokens/s", ".status.tokensPerSecond", 1),
    ]
    names = crd.crd()["spec"]["names"]
    assert names["shortNames"] == ["rljob"] and names["kind"] == "RLTrainingJob"
    conditions = _schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert _schema()["properties"]["status"]["properties"]["lastMetrics"]["additionalProperties"] == {"type": "number"}


def test_the_crd_file_stays_under_the_bound_client_side_apply_can_store():
    """Client-side ``kubectl apply`` keeps the whole object in an annotation, and annotations hold at most 256 KiB."""
    assert len(COMMITTED.read_bytes()) < crd.MAX_CRD_BYTES == 250_000
    assert len(json.dumps(crd.crd(), separators=(",", ":")).encode()) < 256 * 1024 - 1024  # the annotation's JSON


def test_pod_template_fields_carry_kubernetes_schemas_without_nested_descriptions():
    spec = _schema()["properties"]["spec"]["properties"]
    for field, container in crd.POD_TEMPLATE_ROLES.items():
        template = spec[field]["properties"]["podTemplate"]
        assert "podTemplate" not in (spec[field].get("default") or {}) and "default" not in template  # unset stays so
        pod = template["properties"]["spec"]["properties"]
        volumes = pod["volumes"]
        assert volumes["description"].startswith("Appended to rljob's volumes")
        assert {k: v for k, v in volumes.items() if k != "description"} == kube_schemas.inline("PodSpec.volumes")
        assert (volumes["x-kubernetes-list-type"], volumes["x-kubernetes-list-map-keys"]) == ("map", ["name"])
        assert volumes["items"]["required"] == ["name"]
        affinity = pod["affinity"]["properties"]["nodeAffinity"]["properties"]
        terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["required"] == ["nodeSelectorTerms"] and terms["properties"]["nodeSelectorTerms"]["type"] == "array"
        sidecar = pod["initContainers"]["items"]["properties"]
        assert sidecar["restartPolicy"] == {"type": "string"} and sidecar["ports"]["items"]["properties"]["protocol"] \
            == {"type": "string", "default": "TCP"}  # Kubernetes' +default kept, as on a Pod
        assert sidecar["resources"]["properties"]["limits"]["additionalProperties"]["x-kubernetes-int-or-string"]
        spread = pod["topologySpreadConstraints"]["items"]["properties"]
        assert "default" not in spread["whenUnsatisfiable"]  # required: no zero-value default from the generator
        for path, node in _walk(template, "podTemplate"):
            if isinstance(node, crd.Vendored):
                assert "description" not in node, path
        override = pod["containers"]
        # every property of Kubernetes' Container is known, so that CEL, not "unknown field", says why one is refused
        kubernetes = kube_schemas.inline_type("Container")["properties"]
        assert set(override["items"]["properties"]) == set(kubernetes)
        own = ("name", "env", "envFrom", "volumeMounts", "securityContext")
        others = [name for name in kubernetes if name not in own]
        assert {"image", "command", "args", "ports", "resources", "livenessProbe", "restartPolicy"} <= set(others)
        for name in others:  # typed as Kubernetes types them, their content not checked: any value is refused
            assert isinstance(override["items"]["properties"][name], crd.Vendored), name
            assert override["items"]["properties"][name] == crd.refused_shape(kubernetes[name]), name
            assert override["items"]["properties"][name]["type"] == kubernetes[name]["type"], name
        assert override["items"]["properties"]["command"] == {"type": "array", "items": {"type": "string"}}
        assert override["items"]["properties"]["livenessProbe"] == {"type": "object",
                                                                     "x-kubernetes-preserve-unknown-fields": True}
        assert override["items"]["properties"]["ports"] == {"type": "array", "items": {
            "type": "object", "x-kubernetes-preserve-unknown-fields": True}}
        # rljob's own additions keep Kubernetes' whole schema
        for name in ("env", "envFrom", "volumeMounts", "securityContext"):
            assert {k: v for k, v in override["items"]["properties"][name].items() if k != "description"} == \
                kubernetes[name], name
        assert override["items"]["properties"]["name"] == {
            "type": "string", "description": override["items"]["properties"]["name"]["description"],
            "minLength": 1, "maxLength": 63}  # bounded, with maxItems, so that the API server can bound the CEL cost
        assert (override["maxItems"], override["items"]["required"]) == (16, ["name"])
        assert "x-kubernetes-validations" not in override
        assert override["items"]["x-kubernetes-validations"] == [
            rules.cel_own_container_only(container), rules.cel_own_container_fields(container, others)]
        name_rule, fields_rule = override["items"]["x-kubernetes-validations"]
        assert (name_rule["rule"], name_rule["fieldPath"]) == (f"self.name == '{container}'", ".name")
        assert fields_rule["rule"].startswith(
            f"self.name != '{container}' || !(has(self.args) || has(self.command) || has(self.image) || ")
        assert template["properties"]["metadata"]["properties"]["labels"]["additionalProperties"] == {"type": "string"}


def test_the_scale_subresource_scales_the_rollout_replicas_through_fields_the_schema_has():
    version = crd.crd()["spec"]["versions"][0]
    assert sorted(version["subresources"]) == ["scale", "status"]
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.rollout.replicas",
                                                "statusReplicasPath": ".status.rolloutReplicas",
                                                "labelSelectorPath": ".status.rolloutSelector"}
    schema = _schema()["properties"]
    assert schema["spec"]["properties"]["rollout"]["properties"]["replicas"]["type"] == "integer"
    assert schema["status"]["properties"]["rolloutReplicas"]["type"] == "integer"
    assert schema["status"]["properties"]["rolloutSelector"]["type"] == "string"
