"""Pure: which rendered children need applying, judged from the children as the API server holds them.

Each applied child (ConfigMap, Services, Redis Deployment) carries the hash of its rendered manifest in the
``rljob.dev/applied-hash`` annotation (:func:`stamp`). A restarted operator reads the children (GET, no list or
watch) and applies only those that are :func:`outdated`, so a restart costs an idle job no write.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

from rljob_api import constants as c
from rljob_api.canonical import canonical_hash


def manifest_hash(manifest: Mapping[str, Any]) -> str:
    """First 16 hex digits of sha256 over ``manifest`` as canonical JSON, its own applied-hash annotation left out."""
    bare = copy.deepcopy(dict(manifest))
    annotations = (bare.get("metadata") or {}).get("annotations") or {}
    annotations.pop(c.ANNOTATION_APPLIED_HASH, None)
    if "metadata" in bare and not annotations:
        bare["metadata"].pop("annotations", None)
    return canonical_hash(bare, digits=16)


def stamp(manifest: dict[str, Any]) -> dict[str, Any]:
    """Put :func:`manifest_hash` into ``manifest``'s ``rljob.dev/applied-hash`` annotation (in place); returns it.
    Stamp after adopting: the owner reference is part of what is applied."""
    annotations = manifest.setdefault("metadata", {}).setdefault("annotations", {})
    annotations[c.ANNOTATION_APPLIED_HASH] = manifest_hash(manifest)
    return manifest


def contains(live: Any, wanted: Any) -> bool:
    """Whether ``live`` holds every field of ``wanted`` with the same value: mappings may hold more keys (the API
    server's defaults, other managers' fields) and may leave out a key whose wanted value is a zero value (false, 0,
    "", empty), as the API server does for ``omitempty`` fields (e.g. ``publishNotReadyAddresses: false``); lists
    must have the same length and hold each item in order."""
    if isinstance(wanted, Mapping):
        return isinstance(live, Mapping) and all(
            contains(live[k], v) if k in live else _zero(v) for k, v in wanted.items()
        )
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(contains, live, wanted))
    return live == wanted


def _zero(value: Any) -> bool:
    return value is None or (not value and isinstance(value, (bool, int, float, str, Mapping, list)))


def outdated(live: Optional[Mapping[str, Any]], wanted: Mapping[str, Any]) -> bool:
    """Whether ``wanted`` (a :func:`stamp`-ed manifest) must be applied over ``live`` (the object as the API server
    holds it, None when missing): missing, stamped by another rendering (a spec change while no operator ran, or
    another operator version), or edited since (a field the operator sets differs)."""
    if live is None:
        return True
    applied = ((live.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_APPLIED_HASH)
    return applied != wanted["metadata"]["annotations"][c.ANNOTATION_APPLIED_HASH] or not contains(live, wanted)
