"""Validate KubeVirt objects against KubeVirt's own CRD schemas, offline.

vmstream mutates VirtualMachines (GPUs, ``cpu.model``, memory requests,
``evictionStrategy``); these helpers prove each produced object is one the
API server's schema accepts, without a cluster. The CRDs are the ones KubeVirt's
virt-operator installs, generated at the pinned version into the cache
(:func:`harness.locations.kubevirt_crd`), never copied into the repo.

The CRDs speak the Kubernetes *structural schema* dialect of OpenAPI v3; it is
translated once per process into Draft 2020-12 JSON Schema for ``jsonschema``:

``nullable: true``
    null is allowed (``"null"`` added to ``type``, and to ``enum`` if any).
    Null on a *non*-nullable field is reported as an error. The API server
    would silently prune it instead, which for us means a value we meant to
    set is lost -- a bug either way.
``x-kubernetes-int-or-string: true``
    ``type: [integer, string]``, replacing the ``anyOf`` the CRD spells out;
    a ``pattern`` (e.g. the resource.Quantity regex) applies to strings only,
    exactly as in Kubernetes.
unknown fields
    A structural schema does not reject unknown fields: the API server prunes
    them (or rejects them only with ``fieldValidation=Strict``). Pruning hides
    our own typos (``cpu.modle`` would vanish), so by default every object
    that has no ``additionalProperties`` and no
    ``x-kubernetes-preserve-unknown-fields`` gets ``additionalProperties:
    false`` and each unknown field is reported. Pass
    ``allow_unknown_fields=True`` to get the lax JSON-Schema behaviour.
    Fields under ``x-kubernetes-preserve-unknown-fields`` are always allowed.
``format``
    Only ``int32``/``int64`` (range), ``date-time`` (RFC 3339) and
    ``quantity`` are checked; any other format is ignored rather than
    half-checked by jsonschema's own, differently defined checkers.
    The int ranges are stricter than the API server (which ignores integer
    formats) but KubeVirt's Go types would fail to decode out-of-range values.
``x-kubernetes-list-type``
    ``set``: duplicate items are errors; ``map``: duplicate
    ``x-kubernetes-list-map-keys`` tuples are errors (as in the API server);
    ``atomic`` only affects server-side apply. ``x-kubernetes-map-type`` too.
``x-kubernetes-validations``
    CEL rules cannot be evaluated here and are ignored; neither are admission
    webhooks run (e.g. ``spec.runStrategy`` is a free string in the schema;
    its allowed values are enforced only by KubeVirt's webhook).
``metadata``
    The CRD says only ``type: object``; the API server validates ObjectMeta
    itself. We check it lightly: known ObjectMeta fields, ``name`` (DNS-1123
    subdomain) or ``generateName`` present at the top, ``namespace`` a
    DNS-1123 label, ``labels`` a map of valid label keys/values,
    ``annotations`` a map of strings. Nested ``metadata`` that the CRD leaves
    as ``x-kubernetes-preserve-unknown-fields`` (``spec.template.metadata``,
    ``dataVolumeTemplates[].metadata``) gets the same light check, since
    KubeVirt decodes it into an ObjectMeta.
top level
    ``apiVersion`` must be ``kubevirt.io/v1`` and ``kind`` the expected kind;
    both are required, as they are for any object sent to the API server.

``default`` values are not applied; ``description`` and other annotations are
dropped. A schema keyword the translator does not know raises ``ValueError``
so that a newer CRD cannot silently weaken the check.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import yaml
from jsonschema import Draft202012Validator, FormatChecker, ValidationError, validators

from harness.locations import kubevirt_crd, kubevirt_examples_dir

__all__ = [
    "KINDS",
    "VERSION",
    "KubeVirtSchemaError",
    "crd_schema",
    "errors",
    "json_schema",
    "validate",
    "validate_vm",
    "validate_vmi",
    "vm_errors",
    "vmi_errors",
]

VERSION = "v1"
GROUP = "kubevirt.io"
#: kind -> CRD plural (file name stem in the generated CRD directory).
KINDS: Mapping[str, str] = {
    "VirtualMachine": "virtualmachines",
    "VirtualMachineInstance": "virtualmachineinstances",
    "KubeVirt": "kubevirts",
}

Json = dict[str, Any]


class KubeVirtSchemaError(AssertionError):
    """Raised by ``validate*``; an AssertionError so pytest shows it as a failure."""

    def __init__(self, kind: str, name: str | None, errors: list[str]) -> None:
        self.kind = kind
        self.errors = errors
        who = f"{kind} {name!r}" if name else kind
        lines = "\n".join(f"  - {e}" for e in errors)
        super().__init__(f"{who} violates the CRD schema ({len(errors)} error(s)):\n{lines}")


# --------------------------------------------------------------------------- loading


def _plural(kind: str) -> str:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(KINDS)}") from None


@lru_cache(maxsize=None)
def _raw_schema(kind: str) -> Json:
    """Parse the CRD once: the files are ~300 KB and parsing dominates start-up."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    path = kubevirt_crd(_plural(kind))
    with path.open(encoding="utf-8") as fh:
        crd = yaml.load(fh, Loader=loader)  # noqa: S506 - a SafeLoader
    names = crd["spec"]["names"]
    if crd["spec"]["group"] != GROUP or names["kind"] != kind:
        raise ValueError(f"{path} defines {names['kind']}.{crd['spec']['group']}, not {kind}")
    for version in crd["spec"]["versions"]:
        if version["name"] == VERSION:
            schema: Json = version["schema"]["openAPIV3Schema"]
            return schema
    raise ValueError(f"{path} has no version {VERSION}")


def crd_schema(kind: str) -> Json:
    """The CRD's own ``openAPIV3Schema`` for ``v1`` (a copy: safe to poke at in tests)."""
    return copy.deepcopy(_raw_schema(kind))


# --------------------------------------------------------------------------- translation

# Same meaning in OpenAPI v3 (structural subset) and JSON Schema 2020-12.
_SAME = frozenset(
    {
        "required", "enum", "pattern", "format", "maximum", "minimum", "multipleOf",
        "maxItems", "minItems", "uniqueItems", "maxLength", "minLength",
        "maxProperties", "minProperties",
    }
)  # fmt: skip
# Annotations, or semantics outside schema validation (see the module docstring).
_IGNORED = frozenset(
    {
        "description", "title", "example", "externalDocs", "default",
        "x-kubernetes-map-type", "x-kubernetes-validations",
        "x-kubernetes-list-map-keys",  # read together with x-kubernetes-list-type
    }
)  # fmt: skip
_HANDLED = frozenset(
    {
        "type", "nullable", "properties", "items", "additionalProperties",
        "allOf", "anyOf", "oneOf", "not", "exclusiveMinimum", "exclusiveMaximum",
        "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-embedded-resource", "x-kubernetes-list-type",
    }
)  # fmt: skip
_INT_OR_STRING_ANYOF = [{"type": "integer"}, {"type": "string"}]

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"^(?=.{{1,253}}$){_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$"
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = rf"^({_DNS1123_LABEL}(\.{_DNS1123_LABEL})*/)?{_LABEL_NAME}$"
_LABEL_VALUE = rf"^({_LABEL_NAME})?$"
# resource.Quantity, spelled exactly as the CRDs spell it in their ``pattern``s.
_QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$"
)


def _object_meta(strict: bool, *, nullable: bool = False, root: bool = False) -> Json:
    """A light ObjectMeta schema: the CRD leaves metadata to the API server."""
    string: Json = {"type": "string"}
    maybe = ["null"]  # Go decodes null into maps, slices and pointers as "unset".
    schema: Json = {
        "type": ["object", "null"] if nullable else "object",
        "properties": {
            "name": {"type": "string", "pattern": _DNS1123_SUBDOMAIN},
            "generateName": string,
            "namespace": {"type": "string", "maxLength": 63, "pattern": f"^{_DNS1123_LABEL}$"},
            "labels": {
                "type": ["object", *maybe],
                "propertyNames": {"pattern": _LABEL_KEY},
                "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE},
            },
            "annotations": {"type": ["object", *maybe], "additionalProperties": string},
            "uid": string,
            "resourceVersion": string,
            "selfLink": string,
            "generation": {"type": "integer", "format": "int64"},
            "creationTimestamp": {"type": ["string", *maybe], "format": "date-time"},
            "deletionTimestamp": {"type": ["string", *maybe], "format": "date-time"},
            "deletionGracePeriodSeconds": {"type": ["integer", *maybe], "format": "int64"},
            "finalizers": {"type": ["array", *maybe], "items": string},
            "ownerReferences": {
                "type": ["array", *maybe],
                "items": {
                    "type": "object",
                    "required": ["apiVersion", "kind", "name", "uid"],
                    "properties": {
                        "apiVersion": string,
                        "kind": string,
                        "name": string,
                        "uid": string,
                        "controller": {"type": "boolean"},
                        "blockOwnerDeletion": {"type": "boolean"},
                    },
                },
            },
            "managedFields": {"type": ["array", *maybe], "items": {"type": "object"}},
        },
    }
    if strict:
        schema["additionalProperties"] = False
        schema["properties"]["ownerReferences"]["items"]["additionalProperties"] = False
    if root:
        schema["x-vmstream-one-of-required"] = ["name", "generateName"]
    return schema


def _is_bare_preserved_object(node: Mapping[str, Any]) -> bool:
    return (
        node.get("type") == "object"
        and node.get("x-kubernetes-preserve-unknown-fields") is True
        and not node.get("properties")
        and "additionalProperties" not in node
    )


def _convert(node: Mapping[str, Any], strict: bool, in_junctor: bool = False) -> Json:
    """Translate one structural-schema node (recursively) to JSON Schema 2020-12."""
    unknown = set(node) - _SAME - _IGNORED - _HANDLED
    if unknown:
        raise ValueError(f"untranslated schema keyword(s) {sorted(unknown)} in {sorted(node)}")
    out: Json = {k: copy.deepcopy(v) for k, v in node.items() if k in _SAME}
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    types: list[str] | None = None
    if int_or_string:
        types = ["integer", "string"]
    elif "type" in node:
        types = [node["type"]]

    for word in ("allOf", "anyOf", "oneOf"):
        if word in node:
            if word == "anyOf" and int_or_string and node[word] == _INT_OR_STRING_ANYOF:
                continue  # expressed by ``types`` with clearer error messages
            out[word] = [_convert(sub, strict, in_junctor=True) for sub in node[word]]
    if "not" in node:
        out["not"] = _convert(node["not"], strict, in_junctor=True)
    for word, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if node.get(word) is True and bound in out:  # OpenAPI 3.0 boolean form
            out[word] = out.pop(bound)
        elif isinstance(node.get(word), int | float) and not isinstance(node[word], bool):
            out[word] = node[word]

    if "properties" in node:
        props: Json = {}
        for name, sub in node["properties"].items():
            if name == "metadata" and _is_bare_preserved_object(sub):
                props[name] = _object_meta(strict, nullable=sub.get("nullable") is True)
            else:
                props[name] = _convert(sub, strict, in_junctor)
        out["properties"] = props
    if "items" in node:
        out["items"] = _convert(node["items"], strict, in_junctor)
    additional = node.get("additionalProperties")
    if isinstance(additional, Mapping):
        out["additionalProperties"] = _convert(additional, strict, in_junctor)
    elif isinstance(additional, bool):
        out["additionalProperties"] = additional

    if node.get("x-kubernetes-embedded-resource") is True:
        props = out.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        props["metadata"] = _object_meta(strict)
        out["required"] = sorted({*out.get("required", []), "apiVersion", "kind"})
    if node.get("x-kubernetes-list-type") in ("set", "map"):
        out["x-kubernetes-list-type"] = node["x-kubernetes-list-type"]
        out["x-kubernetes-list-map-keys"] = list(node.get("x-kubernetes-list-map-keys", []))

    if (
        strict
        and not in_junctor
        and types == ["object"]
        and "additionalProperties" not in out
        and node.get("x-kubernetes-preserve-unknown-fields") is not True
    ):
        out["additionalProperties"] = False

    if node.get("nullable") is True:
        if types is not None and not any(w in out for w in ("allOf", "anyOf", "oneOf", "not")):
            types.append("null")
            if "enum" in out and None not in out["enum"]:
                out["enum"].append(None)
        else:  # no single type to extend: null short-circuits the rest
            return {"anyOf": [{"type": "null"}, _with_types(out, types)]}
    return _with_types(out, types)


def _with_types(out: Json, types: list[str] | None) -> Json:
    if types is not None:
        out["type"] = types[0] if len(types) == 1 else types
    return out


@lru_cache(maxsize=None)
def _json_schema(kind: str, strict: bool) -> Json:
    schema = _convert(_raw_schema(kind), strict)
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": f"{GROUP}/{VERSION}"}
    props["kind"] = {"const": kind}
    props["metadata"] = _object_meta(strict, root=True)
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata"})
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"{kind}.{GROUP}/{VERSION} (translated from the CRD)"
    return schema


def json_schema(kind: str, *, allow_unknown_fields: bool = False) -> Json:
    """The translated Draft 2020-12 schema (a copy), e.g. to dump or inspect."""
    return copy.deepcopy(_json_schema(kind, not allow_unknown_fields))


# --------------------------------------------------------------------------- validator


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)


def _list_type(validator: Any, value: str, instance: Any, schema: Json) -> Iterator[ValidationError]:
    """``set``/``map`` lists reject duplicates, as the API server does."""
    if not validator.is_type(instance, "array"):
        return
    keys: list[str] = schema.get("x-kubernetes-list-map-keys", [])
    seen: dict[str, int] = {}
    for index, item in enumerate(instance):
        if value == "map":
            if not isinstance(item, dict):
                continue
            identity = _canonical([item.get(k) for k in keys])
            what = "duplicate map key " + ", ".join(f"{k}={item.get(k)!r}" for k in keys)
        else:
            identity = _canonical(item)
            what = f"duplicate set item {item!r}"
        if identity in seen:
            yield ValidationError(f"{what} (first at index {seen[identity]})", path=(index,), instance=item)
        else:
            seen[identity] = index


def _one_of_required(
    validator: Any, value: list[str], instance: Any, schema: Json
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "object") and not any(k in instance for k in value):
        yield ValidationError(f"one of {value} is required")


_FORMATS = FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(instance: object) -> bool:
    return not isinstance(instance, int) or isinstance(instance, bool) or -(2**31) <= instance < 2**31


@_FORMATS.checks("int64")
def _int64(instance: object) -> bool:
    return not isinstance(instance, int) or isinstance(instance, bool) or -(2**63) <= instance < 2**63


@_FORMATS.checks("date-time")
def _date_time(instance: object) -> bool:
    if not isinstance(instance, str):
        return True
    if not _RFC3339.match(instance):
        return False
    try:
        datetime.fromisoformat(instance.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


@_FORMATS.checks("quantity")
def _quantity(instance: object) -> bool:
    return not isinstance(instance, str) or bool(_QUANTITY.match(instance))


_Validator = validators.extend(  # type: ignore[no-untyped-call]  # jsonschema's stubs leave extend unannotated
    Draft202012Validator,
    {"x-kubernetes-list-type": _list_type, "x-vmstream-one-of-required": _one_of_required},
)


@lru_cache(maxsize=None)
def _validator(kind: str, strict: bool) -> Any:
    """Build once per process: translation takes a few ms, validation well under that."""
    return _Validator(_json_schema(kind, strict), format_checker=_FORMATS)


# --------------------------------------------------------------------------- reporting

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _IDENT.match(part):
            text += f".{part}" if text else part
        else:
            text += f"[{part!r}]"
    return text


def _join(base: str, name: str) -> str:
    return _path([name]) if not base else base + ("." + name if _IDENT.match(name) else f"[{name!r}]")


def _json_type(value: object) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "boolean"
        case int():
            return "integer"
        case float():
            return "number"
        case str():
            return "string"
        case list():
            return "array"
        case dict():
            return "object"
    return type(value).__name__


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _messages(error: ValidationError) -> Iterator[str]:
    where = _path(error.absolute_path)
    here = where or "<root>"
    # The typed stubs allow an unset instance and value; an error that was raised has both.
    instance: Any = error.instance
    value: Any = error.validator_value
    if list(error.absolute_schema_path)[-2:-1] == ["propertyNames"]:
        yield f"{here}: invalid key {_short(instance)} ({error.validator} {value!r})"
        return
    match error.validator:
        case "additionalProperties" if value is False:
            known = set(error.schema.get("properties", {})) if isinstance(error.schema, Mapping) else set()
            for name in sorted(set(instance) - known):
                yield f"{_join(where, name)}: unknown field"
        case "required":
            for name in value:
                if name not in instance:
                    yield f"{_join(where, name)}: required field missing"
        case "type":
            wanted = " or ".join(value) if isinstance(value, list) else value
            got = _json_type(instance)
            yield f"{here}: expected {wanted}, got {got}" + ("" if instance is None else f" {_short(instance)}")
        case "enum":
            yield f"{here}: {_short(instance)} is not one of {value}"
        case "const":
            yield f"{here}: must be {value!r}, got {_short(instance)}"
        case "pattern" if value == _QUANTITY.pattern:
            yield f"{here}: {_short(instance)} is not a resource quantity (e.g. 2Gi, 500m, 1024)"
        case "pattern":
            yield f"{here}: {_short(instance)} does not match {value!r}"
        case "format":
            yield f"{here}: {_short(instance)} is not a valid {value}"
        case _:
            detail = error.message if len(error.message) < 300 else error.message[:297] + "..."
            yield f"{here}: {detail}"
            if error.context:  # anyOf/oneOf: say why the closest branch failed
                for sub in error.context:
                    yield from (f"{m} (in {error.validator})" for m in _messages(sub))


# --------------------------------------------------------------------------- public API


def errors(kind: str, obj: dict[str, Any], *, allow_unknown_fields: bool = False) -> list[str]:
    """Every schema violation of ``obj`` as ``"json.path: message"``, sorted; [] if valid.

    ``obj`` must be plain JSON data (dict/list/str/int/float/bool/None), as it
    would be serialised for the API server: a tuple or datetime is an error.
    """
    found = {
        message
        for error in _validator(kind, not allow_unknown_fields).iter_errors(obj)
        for message in _messages(error)
    }
    return sorted(found)


def validate(kind: str, obj: dict[str, Any], *, allow_unknown_fields: bool = False) -> None:
    """Raise :class:`KubeVirtSchemaError` listing every violation, if there is any."""
    found = errors(kind, obj, allow_unknown_fields=allow_unknown_fields)
    if found:
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        name = meta.get("name") if isinstance(meta, Mapping) else None
        raise KubeVirtSchemaError(kind, name if isinstance(name, str) else None, found)


def vm_errors(obj: dict[str, Any], *, allow_unknown_fields: bool = False) -> list[str]:
    """:func:`errors` for a VirtualMachine."""
    return errors("VirtualMachine", obj, allow_unknown_fields=allow_unknown_fields)


def validate_vm(obj: dict[str, Any], *, allow_unknown_fields: bool = False) -> None:
    """:func:`validate` for a VirtualMachine."""
    validate("VirtualMachine", obj, allow_unknown_fields=allow_unknown_fields)


def vmi_errors(obj: dict[str, Any], *, allow_unknown_fields: bool = False) -> list[str]:
    """:func:`errors` for a VirtualMachineInstance."""
    return errors("VirtualMachineInstance", obj, allow_unknown_fields=allow_unknown_fields)


def validate_vmi(obj: dict[str, Any], *, allow_unknown_fields: bool = False) -> None:
    """:func:`validate` for a VirtualMachineInstance."""
    validate("VirtualMachineInstance", obj, allow_unknown_fields=allow_unknown_fields)


def example_vms() -> list[dict[str, Any]]:
    """The VirtualMachines of KubeVirt's own ``examples/`` at the pinned version: VMs KubeVirt
    itself writes, for the rules to take as they come, found beside the CRDs."""
    found = []
    for path in sorted(kubevirt_examples_dir().glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "VirtualMachine":
                found.append(doc)
    assert found, f"no VirtualMachine examples found in {kubevirt_examples_dir()}"
    return found
