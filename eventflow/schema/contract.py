"""What a published schema promises: its contract, and how two contracts differ.

A published version is immutable, but only what validation depends on counts: ``$ref`` are
inlined (renaming a nested model class is not a change) and annotations are dropped
(titles, descriptions, examples). :func:`contract_diff` names each change by field path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

__all__ = ["ANNOTATIONS", "contract", "contract_diff", "resolve"]

ANNOTATIONS = frozenset(
    {"title", "description", "examples", "$comment", "$schema", "$id", "deprecated"}
)
"""Keywords that document a schema without changing what validates."""

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _pointer(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise ValueError(f"only local $ref are supported, got {ref!r}")
    node = root
    for part in ref[1:].split("/")[1:]:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def resolve(schema: Any, root: Any) -> Any:
    """Follow ``$ref`` and single ``allOf`` wrappers, keeping sibling keywords."""
    seen = 0
    while isinstance(schema, dict) and seen < 64:
        seen += 1
        if "$ref" in schema:
            target = _pointer(root, schema["$ref"])
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest} if isinstance(target, dict) else target
        elif isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            inner = resolve(schema["allOf"][0], root)
            schema = {**inner, **rest} if isinstance(inner, dict) else inner
        else:
            break
    return schema


def contract(schema: dict[str, Any]) -> Any:
    """The schema with ``$ref`` inlined and annotations dropped: what validation depends on.

    Renaming a model class or editing a docstring leaves the contract unchanged.
    """

    def walk(node: Any, expanding: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in expanding:
                return {"$ref": "(recursive)"}
            rest = {k: v for k, v in node.items() if k != "$ref"}
            target = _pointer(schema, ref)
            merged = {**target, **rest} if isinstance(target, dict) else target
            return walk(merged, (*expanding, ref))
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ANNOTATIONS or key in ("$defs", "definitions") or key.startswith("x-"):
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: walk(v, expanding) for k, v in value.items()}
            elif key in _SCHEMA_ONE:
                out[key] = walk(value, expanding)
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [walk(v, expanding) for v in value]
            else:
                out[key] = value
        return out

    return walk(schema, ())


def _field_path(pointer: tuple[str, ...]) -> tuple[str, str]:
    """Split a contract pointer into (field path, keyword)."""
    parts: list[str] = []
    i = 0
    keyword = ""
    while i < len(pointer):
        key = pointer[i]
        if key == "properties" and i + 1 < len(pointer):
            parts.append(pointer[i + 1])
            i += 2
            continue
        if key in ("anyOf", "oneOf", "allOf") and i + 1 < len(pointer):
            i += 2
            continue
        if key == "prefixItems" and i + 1 < len(pointer):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{pointer[i + 1]}]"]
            i += 2
            continue
        if key == "items":
            parts[-1:] = [f"{parts[-1] if parts else ''}[]"]
            i += 1
            continue
        if key == "additionalProperties" and i + 1 < len(pointer):
            parts.append("*")
            i += 1
            continue
        keyword = "/".join(pointer[i:])
        break
    return ".".join(parts), keyword


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value, sort_keys=True)


_ABSENT = object()


def _diff(a: Any, b: Any, pointer: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key == "required" and isinstance(a.get(key), list) and isinstance(b.get(key), list):
                if set(a[key]) != set(b[key]):
                    yield (*pointer, key), a[key], b[key]
                continue
            yield from _diff(a.get(key, _ABSENT), b.get(key, _ABSENT), (*pointer, key))
    elif (
        isinstance(a, list)
        and isinstance(b, list)
        and len(a) == len(b)
        and a
        and (isinstance(a[0], dict))
    ):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _diff(x, y, (*pointer, str(i)))
    elif a != b or type(a) is not type(b):
        yield pointer, a, b


def contract_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Describe how the contract of ``new`` differs from ``old``: one line per change."""
    out: list[str] = []
    for pointer, before, after in _diff(contract(old), contract(new), ()):
        path, keyword = _field_path(pointer)
        where = f"field {path!r}" if path else "the event"
        if keyword == "required" and isinstance(before, list) and isinstance(after, list):
            prefix = f"{path}." if path else ""
            out += [f"field {prefix + f!r}: now required" for f in after if f not in before]
            out += [f"field {prefix + f!r}: no longer required" for f in before if f not in after]
        elif keyword == "" and before is _ABSENT:
            out.append(f"{where}: added")
        elif keyword == "" and after is _ABSENT:
            out.append(f"{where}: removed")
        else:
            out.append(f"{where}: {keyword or 'schema'} {_show(before)} -> {_show(after)}")
    return out


# -- can the reader read what the writer writes? ---------------------------------------------
