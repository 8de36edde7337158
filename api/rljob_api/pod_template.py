"""``spec.<role>.podTemplate``: what a platform adds to the pods rljob renders for a role (trainer, rollout, the managed
Redis), in the manner of Kubeflow Trainer v2's PodTemplateOverrides and JobSet's templates.

The Kubernetes-typed fields stay free-form here (dicts): their schema in the CRD is the one Kubernetes gives them
(:data:`KUBE_FIELD` names it; ``rljob_operator.kube_schemas`` vendors it), so the API server checks them as it checks a
Pod. How they merge onto the rendered pod, and what rljob keeps for itself: ``rljob_operator.overrides``.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from rljob_api.api_model import ApiModel, omitted_at_default

KUBE_FIELD = "x-rljob-kubernetes-field"
"""JSON-schema key of a field whose CRD schema is Kubernetes' own, e.g. ``PodSpec.affinity`` (type.property)."""


def kube(field: str) -> dict[str, Any]:
    """``json_schema_extra`` of a field typed as Kubernetes types ``field`` (``Type.property``)."""
    return {KUBE_FIELD: field}


def kube_list(field: str, description: str) -> Any:
    """A list field typed as Kubernetes' ``field`` (``Type.property``), empty by default."""
    return Field(default_factory=list, json_schema_extra=kube(field), description=description)


def kube_value(field: str, description: str) -> Any:
    """An optional field typed as Kubernetes' ``field`` (``Type.property``), unset by default."""
    return Field(None, json_schema_extra=kube(field), description=description)


MAX_CONTAINER_ENTRIES = 16
"""Bound on ``podTemplate.spec.containers`` (only one entry, rljob's container, is valid): it lets the API server bound
the cost of the CEL rules on its entries. Above the handful of sidecars a user could mistakenly list there, so that
those are refused by the rule that says where sidecars go, not by the bound."""


class _Sparse(ApiModel):
    """A model dumped without its unset and empty fields (None, [], {}), so that the resolved config holds only what
    the user set, and a field added later changes no config that does not set it."""

    @model_serializer(mode="wrap")
    def _without_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value not in (None, [], {})}


class PodMetadataOverride(_Sparse):
    """Labels and annotations added to the role's pods."""

    labels: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=kube("ObjectMeta.labels"),
        description="Added to the pods' labels. Keys under rljob.dev/ and the labels rljob sets are refused.",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=kube("ObjectMeta.annotations"),
        description="Added to the pods' annotations. Keys under rljob.dev/ are refused.",
    )


class ContainerOverride(_Sparse):
    """Additions to rljob's own container of the pod (trainer, rollout or redis)."""

    name: str = Field(
        ..., min_length=1, max_length=63,
        description="Required. The role's own container (trainer, rollout or redis); another name, an extra regular "
        "container, is refused: run it as a native sidecar (initContainers with restartPolicy: Always).",
    )
    env: list[dict[str, Any]] = kube_list(
        "Container.env",
        "Appended to rljob's environment variables (secrets by valueFrom.secretKeyRef: the podTemplate is in "
        "the job's config ConfigMap). Names rljob sets are refused.",
    )
    env_from: list[dict[str, Any]] = kube_list(
        "Container.envFrom",
        "ConfigMaps and Secrets whose keys become environment variables; rljob's own env wins over them.",
    )
    volume_mounts: list[dict[str, Any]] = kube_list(
        "Container.volumeMounts",
        "Appended to rljob's mounts (of volumes in spec.volumes, or rljob's own); a mountPath at or under "
        "one of rljob's mounts is refused.",
    )
    security_context: Optional[dict[str, Any]] = kube_value(
        "Container.securityContext",
        "Merged over rljob's container securityContext field by field, e.g. capabilities {add: [IPC_LOCK]} for "
        "RDMA.",
    )


class PodSpecOverride(_Sparse):
    """Pod-level settings of the role's pods; unset fields keep what rljob renders."""

    service_account_name: Optional[str] = kube_value(
        "PodSpec.serviceAccountName",
        "ServiceAccount the pods run as (unset: the namespace's default).",
    )
    automount_service_account_token: Optional[bool] = kube_value(
        "PodSpec.automountServiceAccountToken",
        "rljob renders false; true mounts the ServiceAccount's token, for a sidecar that calls the Kubernetes API.",
    )
    priority_class_name: Optional[str] = kube_value(
        "PodSpec.priorityClassName", "PriorityClass of the pods.",
    )
    runtime_class_name: Optional[str] = kube_value(
        "PodSpec.runtimeClassName",
        "RuntimeClass of the pods (e.g. nvidia).",
    )
    scheduler_name: Optional[str] = kube_value(
        "PodSpec.schedulerName",
        "Scheduler of the pods (unset: default-scheduler).",
    )
    affinity: Optional[dict[str, Any]] = kube_value(
        "PodSpec.affinity",
        "Node, pod and anti-pod affinity of the pods (spec.<role>.nodeSelector still applies).",
    )
    topology_spread_constraints: list[dict[str, Any]] = kube_list(
        "PodSpec.topologySpreadConstraints",
        "How the pods spread over zones or nodes; select the role's pods with the labels "
        "rljob.dev/job-name and rljob.dev/role.",
    )
    image_pull_secrets: list[dict[str, Any]] = kube_list(
        "PodSpec.imagePullSecrets",
        "Secrets for pulling the pods' images from a private registry.",
    )
    security_context: Optional[dict[str, Any]] = kube_value(
        "PodSpec.securityContext",
        "Merged over rljob's pod securityContext field by field.",
    )
    volumes: list[dict[str, Any]] = kube_list(
        "PodSpec.volumes",
        "Appended to rljob's volumes (datasets, model caches, credentials); the names rljob's own "
        "volumes use are refused.",
    )
    init_containers: list[dict[str, Any]] = kube_list(
        "PodSpec.initContainers",
        "Run before rljob's container to completion, or with restartPolicy: Always as native sidecars beside it "
        "(log shippers, proxies). Names of rljob's containers and its ports are refused.",
    )
    containers: list[ContainerOverride] = Field(
        default_factory=list,
        max_length=MAX_CONTAINER_ENTRIES,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Additions to rljob's own container, named as the role: env, envFrom, volumeMounts, "
        "securityContext; its other fields and extra containers are refused (a sidecar goes to initContainers).",
    )


class PodTemplateOverride(_Sparse):
    """What is added to, or set on, every pod rljob renders for a role; rljob's own parts are refused (the Valid
    condition names the field)."""

    metadata: PodMetadataOverride = Field(
        default_factory=PodMetadataOverride, description="Labels and annotations of the pods.",
    )
    spec: PodSpecOverride = Field(default_factory=PodSpecOverride, description="Pod-level settings and containers.")

    def is_empty(self) -> bool:
        """Whether it adds nothing (then the pods are exactly what rljob renders)."""
        return self == PodTemplateOverride()


def pod_template_field(role: str, on_change: str) -> Any:
    """The ``podTemplate`` field of ``spec.<role>``: unset by default and left out of the resolved config while unset
    or empty (:func:`~rljob_api.api_model.omitted_at_default`), so that jobs which do not use it keep their hashes;
    ``on_change`` says what an edit of it replaces."""
    return Field(
        None,
        exclude_if=omitted_at_default(None, PodTemplateOverride()),
        description=f"Additions to the {role} pods, merged onto what rljob renders (docs/pod-templates.md); what rljob "
        f"sets itself is refused, naming the field. {on_change}",
    )
