"""API access for the agent: plain JSON dicts in and out over the kubernetes client's configured
transport (TLS, client certs or tokens from the kubeconfig), plus a list+watch :class:`Informer`.

Dicts keep the API's own field names (camelCase), so the pure modules (podenv, volumes, dns,
podstatus) read objects exactly as ``kubectl get -o json`` prints them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from urllib.parse import quote

from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

__all__ = ["ApiException", "Informer", "Kube", "is_status"]

log = logging.getLogger(__name__)

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


def is_status(e: BaseException, *codes: int) -> bool:
    """True when ``e`` is an API error with one of the HTTP status ``codes``."""
    return isinstance(e, ApiException) and e.status in codes


class Kube:
    """A few verbs on raw API paths (``/api/v1/namespaces/ns/pods``), JSON dicts in and out.

    Args:
        kubeconfig: path of the kubeconfig to use (the admin one of the local control plane).
    """

    def __init__(self, kubeconfig: str) -> None:
        self.client = kube_config.new_client_from_config(config_file=kubeconfig)
        self.client.configuration.connection_pool_maxsize = 64
        self.client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 64
        self.server = self.client.configuration.host

    def _call(self, method: str, path: str, *, query: dict | None = None, body=None,
              content_type: str | None = None, timeout: float | tuple = 30):
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        req = self.client.param_serialize(
            method, path, query_params=[(k, v) for k, v in (query or {}).items() if v is not None],
            header_params=headers, body=body, auth_settings=["BearerToken"],
        )
        return self.client.call_api(*req, _request_timeout=timeout)

    def request(self, method: str, path: str, *, query: dict | None = None, body=None,
                content_type: str | None = None, timeout: float = 30) -> dict:
        """One request; returns the decoded JSON body.

        Raises:
            ApiException: non-2xx status (``.status``, ``.body`` with the API's Status JSON).
        """
        resp = self._call(method, path, query=query, body=body, content_type=content_type, timeout=timeout)
        data = resp.read()
        if not 200 <= resp.status < 300:
            e = ApiException(status=resp.status, reason=resp.reason)
            e.body = data.decode(errors="replace") if data else ""
            raise e
        return json.loads(data) if data else {}

    def get(self, path: str, **query) -> dict:
        return self.request("GET", path, query=query)

    def get_or_none(self, path: str) -> dict | None:
        """GET ``path``; None when it does not exist (404)."""
        try:
            return self.get(path)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, path: str, body: dict) -> dict:
        return self.request("POST", path, body=body)

    def patch(self, path: str, body: dict, strategic: bool = True) -> dict:
        return self.request("PATCH", path, body=body, content_type=STRATEGIC if strategic else MERGE)

    def delete(self, path: str, body: dict | None = None) -> dict:
        return self.request("DELETE", path, body=body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 30, **query) -> Iterator[dict]:
        """Watch events (``{"type", "object"}``) from ``resource_version`` until the server ends
        the stream after ``timeout_seconds``.

        Raises:
            ApiException: the server refused the watch, or sent an ERROR event (410: expired).
        """
        q = dict(query, watch="true", resourceVersion=resource_version, allowWatchBookmarks="true",
                 timeoutSeconds=str(timeout_seconds))
        resp = self._call("GET", path, query=q, timeout=(10, timeout_seconds + 15))
        try:
            if not 200 <= resp.status < 300:
                e = ApiException(status=resp.status, reason=resp.reason)
                e.body = resp.read().decode(errors="replace")
                raise e
            for line in iter_resp_lines(resp.response):
                if not line:
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    obj = event.get("object") or {}
                    raise ApiException(status=obj.get("code", 500), reason=obj.get("message", ""))
                yield event
        finally:
            resp.response.release_conn()


def pod_path(namespace: str, name: str = "", sub: str = "") -> str:
    """``/api/v1/namespaces/<ns>/pods[/<name>[/<sub>]]``."""
    p = f"/api/v1/namespaces/{quote(namespace)}/pods"
    if name:
        p += f"/{quote(name)}"
    if sub:
        p += f"/{sub}"
    return p


Handler = Callable[[str, dict], None]


class Informer:
    """List + watch one collection and call ``handler(event_type, obj)`` for ADDED, MODIFIED and
    DELETED (client-go's reflector, reduced). After an error or an expired watch (410) it lists
    again and reports the differences against what it had, so the handler never misses a change.

    Args:
        kube: API access.
        path: collection path, e.g. ``/api/v1/pods``.
        handler: called on the informer's thread; exceptions are logged, never fatal.
        query: list/watch query parameters (``fieldSelector``, ``labelSelector``).
    """

    def __init__(self, kube: Kube, path: str, handler: Handler, *, query: dict | None = None, name: str = "") -> None:
        self.kube = kube
        self.path = path
        self.handler = handler
        self.query = dict(query or {})
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._known: dict[str, dict] = {}
        self._thread = threading.Thread(target=self._run, name=name or f"informer {path}", daemon=True)

    def start(self) -> Informer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the current watch request ends (at most ~30 s; the thread is a daemon)."""
        self._stop.set()

    def objects(self) -> list[dict]:
        """A snapshot of the objects the informer knows."""
        return list(self._known.values())

    @staticmethod
    def _key(obj: dict) -> str:
        meta = obj.get("metadata") or {}
        return meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}"

    def _fire(self, event_type: str, obj: dict) -> None:
        try:
            self.handler(event_type, obj)
        except Exception:
            log.exception("informer %s: handler failed on %s", self.path, event_type)

    def _relist(self) -> str:
        listed = self.kube.get(self.path, **self.query)
        fresh = {self._key(o): o for o in listed.get("items") or []}
        for key in list(self._known):
            if key not in fresh and not self._stop.is_set():
                self._fire("DELETED", self._known.pop(key))
        for key, obj in fresh.items():
            kind = "MODIFIED" if key in self._known else "ADDED"
            self._known[key] = obj
            self._fire(kind, obj)
        self.synced.set()
        return listed["metadata"]["resourceVersion"]

    def _run(self) -> None:
        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                for event in self.kube.watch(self.path, rv, **self.query):
                    if self._stop.is_set():
                        return
                    obj = event["object"]
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    if event["type"] == "BOOKMARK":
                        continue
                    key = self._key(obj)
                    if event["type"] == "DELETED":
                        self._known.pop(key, None)
                    else:
                        self._known[key] = obj
                    self._fire(event["type"], obj)
            except Exception as e:  # noqa: BLE001 - reconnect on anything; relist when unsure
                if self._stop.is_set():
                    return
                if not is_status(e, 410):
                    log.warning("informer %s: %s; listing again", self.path, e)
                    self._stop.wait(1.0)
                rv = None
