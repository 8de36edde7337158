"""The operator's only Kubernetes API calls (kubernetes.aio's ApiClient, plain dicts in and out).

- :meth:`KubeApi.apply`: server-side apply with field manager ``rljob-operator`` (idempotent; unchanged
  objects are not rewritten) for ConfigMaps, Services and Deployments;
- :meth:`KubeApi.create`: create-only (pods, the generated Secret, the Redis data claim): an existing object is kept
  as it is;
- :meth:`KubeApi.delete`: delete by name, optionally only the exact object (uid precondition);
- :meth:`KubeApi.patch_status`: JSON merge patch of the job's status with a resourceVersion precondition, so a
  decision taken on a stale view of the job is refused (409) instead of written;
- :meth:`KubeApi.patch`: JSON merge patch of another object (a Kueue Workload's spec or status), optionally with a
  resourceVersion precondition;
- :meth:`KubeApi.list`, :meth:`KubeApi.get`, :meth:`KubeApi.secret_value`.

Every request is reported to ``on_request(verb, resource)`` (verb: apply, create, get, delete, list or patch; resource:
the plural, ``rltrainingjobs/status`` for status writes), which the operator counts as a Prometheus metric.

Errors come back as :class:`ApiError` (the HTTP status, reason and the API server's message); the job's daemon counts
them and retries with a backoff (:mod:`.handlers`), and a pass turns 400/422 on a child into a spec problem.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import aiohttp
import kopf
from kubernetes.aio import config as kube_config
from kubernetes.aio.client import ApiClient, Configuration

from rljob_api import constants as c

#: plural of every kind the operator writes
PLURALS = {
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Service": "services",
    "Pod": "pods",
    "Deployment": "deployments",
    "NetworkPolicy": "networkpolicies",
    "Node": "nodes",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Event": "events",
    c.KIND: c.PLURAL,
    "Workload": "workloads",
    "ResourceFlavor": "resourceflavors",
    "WorkloadPriorityClass": "workloadpriorityclasses",
}
_SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class ApiError(Exception):
    """A non-2xx answer of the API server: ``status`` (HTTP code; 0 when it could not be reached), ``reason``
    and the Status ``message``."""

    def __init__(self, status: int, reason: str, message: str, what: str) -> None:
        super().__init__(f"{what}: HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def adopt(children: Iterable[dict[str, Any]], owner: Mapping[str, Any]) -> None:
    """Give each child the owner's namespace and a controller owner reference to it (deletion cascades).

    Unlike ``kopf.adopt`` the owner's labels are not copied: children carry exactly the labels
    :mod:`rljob_operator.render` gives them (the Kueue queue-name label stays on the job: its Workload is the operator's).
    """
    children = list(children)
    kopf.append_owner_reference(children, owner=owner)
    kopf.adjust_namespace(children, namespace=owner["metadata"]["namespace"])


def _path(api_version: str, plural: str, namespace: Optional[str], name: Optional[str] = None,
          subresource: Optional[str] = None) -> str:
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = root + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def _object_path(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return _path(obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"], meta["name"])


class KubeApi:
    """Async access to the API server for the operator (one per operator process).

    Args:
        client: the kubernetes.aio ApiClient (credentials, server).
        on_request: called with (verb, resource) before each request is sent.
    """

    def __init__(self, client: ApiClient, on_request: Callable[[str, str], None] = lambda verb, resource: None) -> None:
        self._client = client
        self._on_request = on_request

    @classmethod
    async def connect(cls, kubeconfig: Optional[str] = None,
                      on_request: Callable[[str, str], None] = lambda verb, resource: None) -> "KubeApi":
        """Credentials from ``kubeconfig``, $KUBECONFIG / ~/.kube/config, or the pod's service account."""
        configuration = Configuration()
        in_cluster = os.environ.get("KUBERNETES_SERVICE_HOST") and _SERVICE_ACCOUNT_TOKEN.exists()
        if kubeconfig is None and in_cluster and not os.environ.get("KUBECONFIG"):
            kube_config.load_incluster_config(client_configuration=configuration)
        else:
            await kube_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return cls(ApiClient(configuration), on_request)

    async def close(self) -> None:
        await self._client.close()

    async def _request(self, method: str, path: str, what: str, counted: tuple[str, str], *, body: Any = None,
                       query: Optional[dict[str, Any]] = None, content_type: str = "application/json") -> Any:
        self._on_request(*counted)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        params = await self._client.param_serialize(
            method, path, query_params=list((query or {}).items()) or None, header_params=headers, body=body,
            auth_settings=["BearerToken"],
        )
        try:
            response = await self._client.call_api(*params, _request_timeout=30)
            data = await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise ApiError(0, "Unreachable", f"{type(err).__name__}: {err}", what) from err
        if response.status >= 300:
            try:  # a Status object; an API group the server does not serve answers with plain text
                payload = json.loads(data) if data else None
            except ValueError:
                payload = None
            message = payload.get("message", "") if isinstance(payload, dict) else (data or b"").decode(errors="replace")
            raise ApiError(response.status, response.reason or "", message.strip(), what)
        return json.loads(data) if data else None

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (field manager rljob-operator, conflicts forced)."""
        what = f"apply {obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"
        return await self._request(
            "PATCH", _object_path(obj), what, ("apply", PLURALS[obj["kind"]]), body=dict(obj),
            query={"fieldManager": c.FIELD_MANAGER, "force": "true"}, content_type="application/apply-patch+yaml",
        )

    async def create(self, obj: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """Create ``obj``; None when an object of that name already exists (it is left untouched)."""
        meta = obj["metadata"]
        what = f"create {obj['kind']} {meta['namespace']}/{meta['name']}"
        path = _path(obj["apiVersion"], PLURALS[obj["kind"]], meta["namespace"])
        try:
            return await self._request("POST", path, what, ("create", PLURALS[obj["kind"]]), body=dict(obj),
                                       query={"fieldManager": c.FIELD_MANAGER})
        except ApiError as err:
            if err.status == 409 and err.reason == "Conflict" and "already exists" in err.message:
                return None
            raise

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Optional[dict[str, Any]]:
        """The object, or None when it does not exist."""
        try:
            return await self._request("GET", _path(api_version, PLURALS[kind], namespace, name),
                                       f"get {kind} {namespace}/{name}", ("get", PLURALS[kind]))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    async def delete(self, api_version: str, kind: str, namespace: str, name: str, *,
                     uid: Optional[str] = None, grace_period_seconds: Optional[int] = None) -> bool:
        """Delete (background propagation); only the object with ``uid`` when given; ``grace_period_seconds`` 0 forces
        a pod out of the API at once, without its kubelet's confirmation. False when already gone."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if uid:
            options["preconditions"] = {"uid": uid}
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        try:
            await self._request("DELETE", _path(api_version, PLURALS[kind], namespace, name),
                                f"delete {kind} {namespace}/{name}", ("delete", PLURALS[kind]), body=options)
        except ApiError as err:
            if err.status == 404 or (uid and err.status == 409):
                return False
            raise
        return True

    async def list(self, api_version: str, kind: str, namespace: Optional[str] = None,
                   label_selector: Optional[str] = None, field_selector: Optional[str] = None) -> list[dict[str, Any]]:
        """Every object of a kind (in ``namespace``, or cluster-wide when None) matching ``label_selector`` and
        ``field_selector`` (e.g. ``involvedObject.name=x`` for Events)."""
        query = {key: value for key, value in (("labelSelector", label_selector), ("fieldSelector", field_selector))
                 if value} or None
        payload = await self._request("GET", _path(api_version, PLURALS[kind], namespace),
                                      f"list {kind} in {namespace or 'all namespaces'}", ("list", PLURALS[kind]),
                                      query=query)
        return list(payload.get("items") or [])

    async def patch_status(self, namespace: str, name: str, patch: Mapping[str, Any],
                           resource_version: Optional[str]) -> dict[str, Any]:
        """Merge-patch the job's status subresource; refused with 409 when the job changed since
        ``resource_version`` (the patch was computed from a stale view). Returns the updated job."""
        return await self.patch(c.API_VERSION, c.KIND, namespace, name, patch, subresource="status",
                                resource_version=resource_version)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *,
                    subresource: Optional[str] = None, resource_version: Optional[str] = None) -> dict[str, Any]:
        """Merge-patch an object (its ``subresource``, e.g. ``status``); refused with 409 when it changed since
        ``resource_version``. Returns the updated object."""
        body = dict(patch)
        if resource_version:
            body["metadata"] = {**(body.get("metadata") or {}), "resourceVersion": resource_version}
        resource = PLURALS[kind] + (f"/{subresource}" if subresource else "")
        return await self._request("PATCH", _path(api_version, PLURALS[kind], namespace, name, subresource),
                                   f"patch {resource} {namespace}/{name}", ("patch", resource), body=body,
                                   content_type="application/merge-patch+json")

    async def secret_value(self, namespace: str, name: str, key: str) -> Optional[str]:
        """The decoded value of one Secret key; None when the Secret or the key is missing."""
        secret = await self.get("v1", "Secret", namespace, name)
        if not secret or key not in (secret.get("data") or {}):
            return None
        return base64.b64decode(secret["data"][key]).decode()
