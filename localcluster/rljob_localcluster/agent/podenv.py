"""A container's environment, command line and downward-API values, resolved from a pod dict the
way kubelet does it (pkg/kubelet/kubelet_pods.go ``makeEnvironmentVariables``,
third_party/forked/golang/expansion ``Expand``, pkg/api/v1/resource ``ExtractResourceValueByContainerName``).

Pure functions over API JSON dicts (camelCase, as ``kubectl get -o json`` prints them); the
ConfigMaps and Secrets they reference come from an :class:`ObjectSource`, so tests need no cluster.
Errors raise :class:`ContainerConfigError` with kubelet's wording; kubelet reports them as the
container's waiting reason ``CreateContainerConfigError`` and retries.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Protocol

from kubernetes.utils import parse_quantity

__all__ = [
    "ContainerConfigError",
    "DictSource",
    "ObjectSource",
    "container_argv",
    "container_env",
    "expand",
    "field_value",
    "resource_value",
]


class ContainerConfigError(Exception):
    """The container cannot be configured (missing ConfigMap/Secret/key, bad field path).

    kubelet shows it as waiting reason ``CreateContainerConfigError`` and retries.
    """

    reason = "CreateContainerConfigError"


class ObjectSource(Protocol):
    """Where referenced ConfigMaps and Secrets come from (the API server, or a dict in tests)."""

    def config_map(self, namespace: str, name: str) -> dict | None:
        """The ConfigMap as an API dict, or None when it does not exist."""

    def secret(self, namespace: str, name: str) -> dict | None:
        """The Secret as an API dict (``data`` values base64), or None when it does not exist."""


class DictSource:
    """An :class:`ObjectSource` over in-memory objects: ``{(kind, namespace, name): obj}`` with
    kind ``"ConfigMap"`` or ``"Secret"``."""

    def __init__(self, objects: Mapping[tuple[str, str, str], dict]) -> None:
        self.objects = dict(objects)

    def config_map(self, namespace: str, name: str) -> dict | None:
        return self.objects.get(("ConfigMap", namespace, name))

    def secret(self, namespace: str, name: str) -> dict | None:
        return self.objects.get(("Secret", namespace, name))


# ---------------------------------------------------------------------------- $(VAR) expansion
def expand(text: str, env: Mapping[str, str]) -> str:
    """Expand ``$(NAME)`` references in ``text`` from ``env`` exactly as Kubernetes does.

    ``$(NAME)`` with NAME in ``env`` becomes its value; an unknown NAME stays ``$(NAME)``
    verbatim; ``$$`` becomes ``$`` (so ``$$(NAME)`` yields the literal ``$(NAME)``); an unclosed
    ``$(`` and any other ``$x`` are copied unchanged. Source: kubernetes
    third_party/forked/golang/expansion/expand.go.
    """
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    n = len(text)
    while cursor < n:
        if text[cursor] == "$" and cursor + 1 < n:
            out.append(text[checkpoint:cursor])
            nxt = text[cursor + 1]
            if nxt == "$":
                out.append("$")
                advance = 1
            elif nxt == "(":
                close = text.find(")", cursor + 2)
                if close == -1:
                    out.append("$(")
                    advance = 1
                else:
                    name = text[cursor + 2:close]
                    out.append(env.get(name, f"$({name})"))
                    advance = close - cursor
            else:
                out.append("$" + nxt)
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    out.append(text[checkpoint:])
    return "".join(out)


# ---------------------------------------------------------------------------- downward API
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['([^']*)'\]$")


def _format_map(m: Mapping[str, str]) -> str:
    """``k="v"`` lines sorted by key (kubelet's FormatMap for downward-API volume files)."""
    return "\n".join(f'{k}="{v}"' for k, v in sorted(m.items()))


def field_value(pod: dict, field_path: str, *, pod_ip: str = "", host_ip: str = "") -> str:
    """Value of a downward-API ``fieldRef.fieldPath`` for ``pod``.

    Supports what kubelet supports: metadata.name/namespace/uid, metadata.labels and
    metadata.annotations (whole map, as ``k="v"`` lines, for volumes) and ``['key']`` subscripts,
    spec.nodeName, spec.serviceAccountName, status.podIP/podIPs, status.hostIP/hostIPs.
    ``pod_ip``/``host_ip`` override the pod's status (the agent knows them before it reports them).

    Raises:
        ContainerConfigError: unsupported field path.
    """
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    pod_ip = pod_ip or status.get("podIP") or ""
    host_ip = host_ip or status.get("hostIP") or ""
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if field_path in simple:
        return simple[field_path] or ""
    if field_path in ("metadata.labels", "metadata.annotations"):
        return _format_map(meta.get(field_path.split(".")[1]) or {})
    m = _SUBSCRIPT.match(field_path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ContainerConfigError(f"unsupported fieldPath: {field_path}")


def resource_value(
    container: dict, resource: str, divisor: str | None, node_allocatable: Mapping[str, str]
) -> str:
    """Value of a downward-API ``resourceFieldRef`` for ``container``, as kubelet writes it.

    ``resource`` is ``limits.<name>`` or ``requests.<name>`` (cpu, memory, ephemeral-storage,
    hugepages-*). An unset limit falls back to the node's allocatable (kubelet's
    MergeContainerResourceLimits); an unset request is 0. The result is ceil(value / divisor) as
    an integer string; ``divisor`` defaults to 1 (cores for cpu, bytes otherwise).

    Raises:
        ContainerConfigError: unknown resource.
    """
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or not name:
        raise ContainerConfigError(f"unsupported container resource: {resource}")
    res = (container.get("resources") or {}).get(kind) or {}
    raw = res.get(name)
    if raw is None and kind == "limits":
        raw = node_allocatable.get(name)
    value = parse_quantity(raw) if raw is not None else Decimal(0)
    div = parse_quantity(divisor) if divisor else Decimal(1)
    if div <= 0:
        raise ContainerConfigError(f"invalid divisor {divisor!r} for {resource}")
    return str(math.ceil(value / div))


def _container_by_name(pod: dict, name: str | None, default: dict) -> dict:
    if not name:
        return default
    spec = pod.get("spec") or {}
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        if c.get("name") == name:
            return c
    raise ContainerConfigError(f"resourceFieldRef: container {name!r} not found in pod")


# ---------------------------------------------------------------------------- ConfigMap / Secret refs
def _decoded_data(kind: str, obj: dict) -> dict[str, str]:
    """A ConfigMap's ``data`` + ``binaryData`` or a Secret's ``data`` (base64-decoded) + ``stringData``."""
    if kind == "ConfigMap":
        out = dict(obj.get("data") or {})
        for k, v in (obj.get("binaryData") or {}).items():
            out[k] = base64.b64decode(v).decode("utf-8", "surrogateescape")
        return out
    out = {k: base64.b64decode(v).decode("utf-8", "surrogateescape") for k, v in (obj.get("data") or {}).items()}
    out.update(obj.get("stringData") or {})
    return out


def _lookup(source: ObjectSource, kind: str, namespace: str, name: str) -> dict | None:
    return source.config_map(namespace, name) if kind == "ConfigMap" else source.secret(namespace, name)


def _key_ref(source: ObjectSource, kind: str, namespace: str, ref: dict) -> str | None:
    name, key, optional = ref.get("name", ""), ref.get("key", ""), bool(ref.get("optional"))
    obj = _lookup(source, kind, namespace, name)
    if obj is None:
        if optional:
            return None
        raise ContainerConfigError(f'{kind.lower()} "{name}" not found')
    data = _decoded_data(kind, obj)
    if key not in data:
        if optional:
            return None
        raise ContainerConfigError(f"couldn't find key {key} in {kind} {namespace}/{name}")
    return data[key]


_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def container_env(
    pod: dict,
    container: dict,
    source: ObjectSource,
    *,
    pod_ip: str = "",
    host_ip: str = "",
    node_allocatable: Mapping[str, str] | None = None,
    cluster_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment as kubelet computes it (without the image's own env).

    Order (later wins): ``cluster_env`` (what kubelet adds itself, e.g. KUBERNETES_SERVICE_HOST/PORT),
    then ``envFrom`` sources in order (keys that are not valid env names are skipped, as kubelet
    does), then ``env`` in order. A literal ``value`` expands ``$(NAME)`` against what is defined
    so far; ``valueFrom`` resolves configMapKeyRef, secretKeyRef, fieldRef and resourceFieldRef.

    Raises:
        ContainerConfigError: a non-optional ConfigMap/Secret or key is missing, or a field or
            resource reference is unsupported.
    """
    namespace = (pod.get("metadata") or {}).get("namespace", "default")
    env: dict[str, str] = dict(cluster_env or {})
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix") or ""
        for kind, ref in (("ConfigMap", src.get("configMapRef")), ("Secret", src.get("secretRef"))):
            if ref is None:
                continue
            obj = _lookup(source, kind, namespace, ref.get("name", ""))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(f'{kind.lower()} "{ref.get("name", "")}" not found')
            for k, v in _decoded_data(kind, obj).items():
                if _ENV_NAME.match(prefix + k):
                    env[prefix + k] = v
    for var in container.get("env") or []:
        name = var["name"]
        value_from = var.get("valueFrom")
        if not value_from:
            env[name] = expand(var.get("value") or "", env)
            continue
        if "configMapKeyRef" in value_from:
            v = _key_ref(source, "ConfigMap", namespace, value_from["configMapKeyRef"])
        elif "secretKeyRef" in value_from:
            v = _key_ref(source, "Secret", namespace, value_from["secretKeyRef"])
        elif "fieldRef" in value_from:
            v = field_value(pod, value_from["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
        elif "resourceFieldRef" in value_from:
            ref = value_from["resourceFieldRef"]
            target = _container_by_name(pod, ref.get("containerName"), container)
            v = resource_value(target, ref["resource"], ref.get("divisor"), node_allocatable or {})
        else:
            raise ContainerConfigError(f"env {name}: unsupported valueFrom {sorted(value_from)}")
        if v is not None:
            env[name] = v
    return env


def container_argv(container: dict, env: Mapping[str, str]) -> list[str]:
    """``command + args`` with ``$(NAME)`` expanded from ``env``.

    Images are never pulled or inspected by the local agent, so an image ENTRYPOINT/CMD cannot
    stand in for a missing ``command``.

    Raises:
        ContainerConfigError: the container sets no ``command``.
    """
    command = container.get("command") or []
    if not command:
        raise ContainerConfigError(
            f"container {container.get('name')!r} sets no command: the rljob local node agent does not "
            f"pull or run images (image {container.get('image')!r} maps to the project's own Python "
            "environment), so every container must set an explicit command"
        )
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]
