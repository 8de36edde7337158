"""The Kubernetes schemas of the pod-template fields (``spec.<role>.podTemplate``), vendored from the OpenAPI v3 spec
of the pinned Kubernetes version: the one exception to "the CRD comes from the pydantic models" (DESIGN §9).

A field of the models that carries ``json_schema_extra={KUBE_FIELD: "PodSpec.affinity"}`` (see
:mod:`rljob_api.pod_template`) gets, in the CRD, the schema Kubernetes gives that property of that type, so that the
API server validates it as it validates a Pod and ``kubectl explain`` shows its shape. ``kube_schemas.json`` beside
this module holds those properties and every definition they reach, in the CRD's structural form, as kubebuilder
writes core types with ``crd:maxDescLen=0``:

- descriptions dropped (only the models' own fields are described), and the patch-strategy, union and
  group-version-kind extensions with them; ``x-kubernetes-list-type``, ``-list-map-keys`` and ``-map-type`` kept;
- ``allOf: [$ref]`` collapsed to a ``$ref`` (inlined by :func:`inline` when the CRD is generated: a structural
  schema has no references); scalar defaults of optional properties kept (``protocol: TCP``, a reference's ``name:
  ""``: Kubernetes' ``+default`` markers, as the API server defaults them on a Pod); object defaults (``{}``) and the
  zero values the OpenAPI generator writes on required properties (``""``, ``0``) dropped, so that a missing required
  field is refused when the job is created, not when its pods are;
- IntOrString and Quantity as kubebuilder writes them (``x-kubernetes-int-or-string``, Quantity with its pattern);
- an embedded ObjectMeta (an ephemeral volume's claim template) with its labels, annotations, finalizers, name and
  namespace, as kubebuilder's ``generateEmbeddedObjectMeta`` writes it (a bare ``type: object`` would prune them).

Regenerate after changing which fields the models vendor, or the pinned Kubernetes version
(``localcluster/gotools/kubernetes/go.mod``)::

    python -m rljob_operator.kube_schemas        # reads the module cache (go mod download k8s.io/kubernetes@<pin>)
    python -m rljob_operator.crd > crds/rltrainingjobs.rljob.dev.yaml

A test regenerates it and compares (where the module cache holds the spec) and checks its version against the pin.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Optional

from rljob_api.pod_template import KUBE_FIELD

VENDORED = Path(__file__).with_name("kube_schemas.json")
"""The committed file (package data of rljob_operator)."""
GO_MOD = Path(__file__).resolve().parents[2] / "localcluster" / "gotools" / "kubernetes" / "go.mod"
"""The wrapper module that pins k8s.io/kubernetes (in a checkout of the repository)."""
OPENAPI_FILE = "api/openapi-spec/v3/api__v1_openapi.json"
"""Where the core/v1 OpenAPI v3 spec lies in the k8s.io/kubernetes module."""

TYPES = {
    "ObjectMeta": "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
    "PodSpec": "io.k8s.api.core.v1.PodSpec",
    "Container": "io.k8s.api.core.v1.Container",
}
"""Short type names a :data:`~rljob_api.pod_template.KUBE_FIELD` may use → their OpenAPI definitions."""
_INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
_OBJECT_META = TYPES["ObjectMeta"]
_EMBEDDED_META = ("annotations", "finalizers", "labels", "name", "namespace")
_KEEP = ("type", "format", "enum", "required", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
         "x-kubernetes-map-type")
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
                    r"|(\.[0-9]+))))?$")
"""A resource quantity (the pattern kubebuilder writes for resource.Quantity)."""
_SPECIAL = {
    _INT_OR_STRING: {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
    _QUANTITY: {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
                "x-kubernetes-int-or-string": True},
}


class VendorError(ValueError):
    """The OpenAPI spec lacks a type or property the models name, or the pinned spec cannot be found (says where)."""


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _convert(node: dict[str, Any], reached: set[str], *, optional_property: bool = False) -> dict[str, Any]:
    """One OpenAPI v3 node → its structural form (module docstring); adds the definitions it references to
    ``reached``. ``optional_property``: the node is a property its object does not require (only those keep a
    default)."""
    if "allOf" in node:
        if len(node["allOf"]) != 1:
            raise VendorError(f"allOf with {len(node['allOf'])} members has no structural form")
        return _convert(node["allOf"][0], reached, optional_property=optional_property)
    if "$ref" in node:
        name = _ref_name(node["$ref"])
        reached.add(name)
        return {"$ref": name}
    out = {key: copy.deepcopy(node[key]) for key in _KEEP if key in node}
    if optional_property and "default" in node and not isinstance(node["default"], (dict, list)):
        out["default"] = node["default"]
    if "properties" in node:
        required = node.get("required") or ()
        out["properties"] = {name: _convert(sub, reached, optional_property=name not in required)
                             for name, sub in node["properties"].items()}
    if "items" in node:
        out["items"] = _convert(node["items"], reached)
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _convert(node["additionalProperties"], reached)
    return out


def _definition(name: str, schemas: dict[str, Any], reached: set[str]) -> dict[str, Any]:
    if name in _SPECIAL:
        return copy.deepcopy(_SPECIAL[name])
    if name not in schemas:
        raise VendorError(f"the OpenAPI spec has no definition {name}")
    node = schemas[name]
    if name == _OBJECT_META:
        node = {**node, "properties": {key: node["properties"][key] for key in _EMBEDDED_META}}
    return _convert(node, reached)


def vendor(openapi: dict[str, Any], fields: Iterable[str], version: str) -> dict[str, Any]:
    """The vendored document for ``fields`` (``Type.property``, types of :data:`TYPES`) of the core/v1 OpenAPI v3
    spec ``openapi`` of Kubernetes ``version``: ``{"kubernetesVersion", "fields": {field: schema}, "definitions":
    {name: schema}}``, every definition a field reaches, transitively.

    Raises:
        VendorError: a type or property is not in the spec.
    """
    schemas = openapi["components"]["schemas"]
    reached: set[str] = set()
    out_fields = {}
    for field in sorted(set(fields)):
        type_name, _, prop = field.partition(".")
        definition = schemas.get(TYPES.get(type_name, ""), {})
        if prop not in definition.get("properties", {}):
            raise VendorError(f"{field}: no such property in the OpenAPI spec of Kubernetes {version}")
        out_fields[field] = _convert(definition["properties"][prop], reached,
                                     optional_property=prop not in (definition.get("required") or ()))
    definitions: dict[str, Any] = {}
    pending = sorted(reached)
    while pending:
        name = pending.pop()
        if name in definitions:
            continue
        found: set[str] = set()
        definitions[name] = _definition(name, schemas, found)
        pending.extend(sorted(found - definitions.keys()))
    return {"kubernetesVersion": version, "source": f"k8s.io/kubernetes@{version} {OPENAPI_FILE}",
            "fields": out_fields, "definitions": dict(sorted(definitions.items()))}


@lru_cache(maxsize=1)
def vendored() -> dict[str, Any]:
    """The committed vendored document (:data:`VENDORED`)."""
    return json.loads(VENDORED.read_text())


def inline(field: str, document: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The structural schema of ``field`` (e.g. ``PodSpec.volumes``) with every reference inlined (a fresh copy).

    Raises:
        VendorError: the field is not vendored (regenerate the vendored file, see the module docstring).
    """
    document = document or vendored()
    if field not in document["fields"]:
        raise VendorError(f"{field} is not vendored: run python -m rljob_operator.kube_schemas")
    return _expand(document["fields"][field], document["definitions"])


def inline_type(name: str, document: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The structural schema of the type ``name`` of :data:`TYPES` (e.g. ``Container``) with every reference inlined
    (a fresh copy).

    Raises:
        VendorError: no vendored field reaches the type.
    """
    document = document or vendored()
    definition = TYPES.get(name, name)
    if definition not in document["definitions"]:
        raise VendorError(f"{name}: no vendored field reaches it")
    return _expand(document["definitions"][definition], document["definitions"])


def _expand(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            return _expand(definitions[node["$ref"]], definitions)
        return {key: _expand(value, definitions) for key, value in node.items()}
    if isinstance(node, list):
        return [_expand(value, definitions) for value in node]
    return node


def model_fields() -> list[str]:
    """Every :data:`~rljob_api.pod_template.KUBE_FIELD` the spec's models name (what :func:`vendor` must cover)."""
    from rljob_api.spec import RLTrainingJobSpec

    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if KUBE_FIELD in node:
                found.add(node[KUBE_FIELD])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(RLTrainingJobSpec.model_json_schema(by_alias=True))
    return sorted(found)


def pinned_version(go_mod: Path = GO_MOD) -> str:
    """The k8s.io/kubernetes version the project builds (``require k8s.io/kubernetes vX.Y.Z`` in ``go_mod``).

    Raises:
        VendorError: no such line.
    """
    match = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", go_mod.read_text(), re.MULTILINE)
    if match is None:
        raise VendorError(f"{go_mod}: no k8s.io/kubernetes requirement")
    return match.group(1)


def module_cache() -> Path:
    """The Go module cache: $GOMODCACHE, `go env GOMODCACHE`, else $GOPATH/pkg/mod or ~/go/pkg/mod."""
    if os.environ.get("GOMODCACHE"):
        return Path(os.environ["GOMODCACHE"])
    try:
        out = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, check=True).stdout.strip()
        if out:
            return Path(out)
    except (OSError, subprocess.CalledProcessError):
        pass
    return Path(os.environ.get("GOPATH") or Path.home() / "go") / "pkg" / "mod"


def openapi_path(version: str, cache: Optional[Path] = None) -> Path:
    """Where the module cache holds the core/v1 OpenAPI v3 spec of k8s.io/kubernetes ``version``."""
    return (cache or module_cache()) / f"k8s.io/kubernetes@{version}" / OPENAPI_FILE


def main(argv: Optional[list[str]] = None) -> None:
    """Write :data:`VENDORED` from the pinned version's OpenAPI spec (or ``--openapi FILE``)."""
    parser = argparse.ArgumentParser(prog="python -m rljob_operator.kube_schemas", description=__doc__.split("\n")[0])
    parser.add_argument("--openapi", type=Path, help="api__v1_openapi.json (default: the pinned version's, from the "
                                                     "Go module cache)")
    parser.add_argument("--output", type=Path, default=VENDORED)
    args = parser.parse_args(argv)
    version = pinned_version()
    source = args.openapi or openapi_path(version)
    if not source.is_file():
        raise SystemExit(f"{source} not found: run `go mod download k8s.io/kubernetes@{version}` in "
                         f"{GO_MOD.parent} (or pass --openapi)")
    document = vendor(json.loads(source.read_text()), model_fields(), version)
    args.output.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
    sys.stderr.write(f"wrote {args.output}: {len(document['fields'])} fields, {len(document['definitions'])} "
                     f"definitions from Kubernetes {version}\n")


if __name__ == "__main__":
    main()
