"""Compatibility of two JSON Schemas of an event, as pydantic models read them.

The question is always "can a reader with schema R read every payload a writer with schema
W writes?" (:func:`reader_accepts`). The modes ask it in one or both directions:

- ``backward``: new readers read old events (R = new, W = old): stored events and
  in-flight messages of the previous version stay readable.
- ``forward``: old readers read new events (R = old, W = new): consumers not yet upgraded
  keep working while producers move first.
- ``full``: both. ``none``: neither is checked.

What that means for object models (pydantic's defaults):

- A field the reader requires must be required in the writer. Added without a default, it
  breaks backward (``required-field-added``); removed, it breaks forward (``field-removed``).
- A field the writer sends and the reader does not declare is ignored, as pydantic ignores
  extra fields, unless the reader forbids extras (``additionalProperties: false``, i.e.
  ``extra="forbid"``). Data is taken to be written by the writer's model, which sends only
  its declared fields.
- Types: the reader must accept every value of the writer's type. ``integer`` -> ``number``
  is a widening (fine backward), the reverse a narrowing. ``null`` counts as a value:
  ``int | None`` -> ``int`` is ``nullable-removed``.
- Enums: a value the writer may send and the reader lacks is ``enum-value-removed``
  backward and ``enum-value-added`` forward.
- Nested models (``$defs`` / ``$ref``), lists, dicts and unions are compared recursively;
  tighter bounds, patterns or formats on the reader are ``constraint-tightened``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from .contract import ANNOTATIONS, resolve

__all__ = ["Direction", "Incompatibility", "compare_versions", "reader_accepts"]

Direction = Literal["backward", "forward"]

_LOWER = (("minimum", "exclusiveMinimum"),)
_UPPER = (("maximum", "exclusiveMaximum"),)
_MIN_COUNTS = ("minLength", "minItems", "minProperties")
_MAX_COUNTS = ("maxLength", "maxItems", "maxProperties")
_EXACT = ("pattern", "format", "multipleOf")

# Internal kind -> rule name, per direction (backward: writer = old; forward: writer = new).
_RULES: dict[str, tuple[str, str]] = {
    "missing": ("required-field-added", "field-removed"),
    "optional": ("field-made-required", "field-made-optional"),
    "extra": ("field-removed", "field-added"),
    "enum": ("enum-value-removed", "enum-value-added"),
    "type": ("type-changed", "type-changed"),
    "null": ("nullable-removed", "nullable-added"),
    "constraint": ("constraint-tightened", "constraint-loosened"),
}


@dataclass(frozen=True)
class Incompatibility:
    """One way a reader would reject what a writer writes."""

    kind: str
    """``missing``, ``optional``, ``extra``, ``enum``, ``type``, ``null`` or ``constraint``."""
    path: str
    """Field path such as ``address.zip`` or ``items[]``; empty for the event itself."""
    detail: str

    def rule(self, direction: Direction) -> str:
        """The rule name, as the change from the old to the new version reads."""
        backward, forward = _RULES[self.kind]
        return backward if direction == "backward" else forward


# -- walking and resolving ------------------------------------------------------------------


def _types(schema: dict[str, Any]) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return set(declared)
    values = _enum(schema)
    if values is not None:
        return {_json_type(v) for v in values}
    if "properties" in schema:
        return {"object"}
    return None


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _enum(schema: dict[str, Any]) -> list[Any] | None:
    if "const" in schema:
        return [schema["const"]]
    values = schema.get("enum")
    return list(values) if isinstance(values, list) else None


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _describe(types: set[str] | None) -> str:
    if types is None:
        return "any"
    return " | ".join(sorted(types))


def _branches(schema: dict[str, Any]) -> list[Any] | None:
    for key in ("anyOf", "oneOf"):
        value = schema.get(key)
        if isinstance(value, list):
            return value
    return None


class _Comparer:
    def __init__(self, writer_root: dict[str, Any], reader_root: dict[str, Any]) -> None:
        self.wroot = writer_root
        self.rroot = reader_root
        self.active: set[tuple[int, int]] = set()

    def accepts(self, w: Any, r: Any, path: str) -> list[Incompatibility]:
        w = resolve(w, self.wroot)
        r = resolve(r, self.rroot)
        if r is True or w is False or (isinstance(r, dict) and not _constraining(r)):
            return []
        if r is False:
            return [Incompatibility("type", path, "the reader accepts no value here")]
        if not isinstance(w, dict) or not isinstance(r, dict):
            return []
        key = (id(w), id(r))
        if key in self.active:  # a recursive model: assume the recursion holds
            return []
        self.active.add(key)
        try:
            return self._accepts(w, r, path)
        finally:
            self.active.discard(key)

    def _accepts(self, w: dict[str, Any], r: dict[str, Any], path: str) -> list[Incompatibility]:
        wbranches = _branches(w)
        if wbranches is not None:
            issues: list[Incompatibility] = []
            for branch in wbranches:
                for issue in self.accepts(branch, r, path):
                    if issue not in issues:
                        issues.append(issue)
            return issues
        rbranches = _branches(r)
        if rbranches is not None:
            results = [self.accepts(w, branch, path) for branch in rbranches]
            if any(not res for res in results):
                return []
            wtypes = _types(w)
            for branch, res in zip(rbranches, results, strict=True):
                btypes = _types(resolve(branch, self.rroot))
                if wtypes and btypes and wtypes & btypes:
                    return res
            rtypes: set[str] = set()
            for branch in rbranches:
                rtypes |= _types(resolve(branch, self.rroot)) or {"any"}
            kind = "null" if wtypes == {"null"} else "type"
            return [Incompatibility(kind, path, f"{_describe(wtypes)} -> {_describe(rtypes)}")]
        wvalues, rvalues = _enum(w), _enum(r)
        if wvalues is not None:
            if rvalues is not None:
                allowed = {_key(v) for v in rvalues}
                lost = [v for v in wvalues if _key(v) not in allowed]
                return [Incompatibility("enum", path, f"values {lost}")] if lost else []
            wtypes_enum = {_json_type(v) for v in wvalues}
            return self._types_ok(w, r, wtypes_enum, path)
        if rvalues is not None:
            return [
                Incompatibility(
                    "enum", path, f"any {_describe(_types(w))} -> only the values {rvalues}"
                )
            ]
        wtypes = _types(w)
        if _types(r) is None:
            return self._structure(w, r, wtypes or set(), path)
        if wtypes is None:
            return [Incompatibility("type", path, f"any -> {_describe(_types(r))}")]
        return self._types_ok(w, r, wtypes, path)

    def _types_ok(
        self, w: dict[str, Any], r: dict[str, Any], wtypes: set[str], path: str
    ) -> list[Incompatibility]:
        rtypes = _types(r) or set()
        issues: list[Incompatibility] = []
        wtypes = set(wtypes)
        if "null" in wtypes and "null" not in rtypes:
            issues.append(Incompatibility("null", path, "null is no longer accepted"))
            wtypes.discard("null")
        bad = {t for t in wtypes if t not in rtypes and not (t == "integer" and "number" in rtypes)}
        if bad:
            wdesc = _describe(wtypes)
            rdesc = _describe(rtypes - {"null"} if "null" not in wtypes else rtypes)
            note = " (a narrowing)" if wtypes == {"number"} and rtypes >= {"integer"} else ""
            issues.append(Incompatibility("type", path, f"{wdesc} -> {rdesc}{note}"))
            return issues
        if _enum(w) is not None:  # enum values against a plain reader type: types suffice
            return issues
        return issues + self._structure(w, r, wtypes, path)

    def _structure(
        self, w: dict[str, Any], r: dict[str, Any], wtypes: set[str], path: str
    ) -> list[Incompatibility]:
        issues: list[Incompatibility] = []
        if "object" in wtypes:
            issues += self._object(w, r, path)
        if "array" in wtypes:
            issues += self._array(w, r, path)
        issues += _constraints(w, r, path)
        return issues

    def _object(self, w: dict[str, Any], r: dict[str, Any], path: str) -> list[Incompatibility]:
        issues: list[Incompatibility] = []
        wprops: dict[str, Any] = w.get("properties", {})
        rprops: dict[str, Any] = r.get("properties", {})
        wreq = set(w.get("required", []))
        for name in r.get("required", []):
            where = _join(path, name)
            if name not in wprops:
                issues.append(Incompatibility("missing", where, "required by the reader"))
            elif name not in wreq:
                issues.append(
                    Incompatibility("optional", where, "required by the reader, optional before")
                )
        radditional = r.get("additionalProperties", True)
        for name, wschema in wprops.items():
            where = _join(path, name)
            if name in rprops:
                issues += self.accepts(wschema, rprops[name], where)
            elif radditional is False:
                issues.append(Incompatibility("extra", where, "the reader forbids unknown fields"))
            elif isinstance(radditional, dict):
                issues += self.accepts(wschema, radditional, where)
        wadditional = w.get("additionalProperties")
        if isinstance(wadditional, dict):
            where = _join(path, "*")
            if radditional is False:
                issues.append(Incompatibility("extra", where, "the reader forbids unknown keys"))
            elif isinstance(radditional, dict):
                issues += self.accepts(wadditional, radditional, where)
        return issues

    def _array(self, w: dict[str, Any], r: dict[str, Any], path: str) -> list[Incompatibility]:
        issues: list[Incompatibility] = []
        wprefix: list[Any] = w.get("prefixItems", [])
        rprefix: list[Any] = r.get("prefixItems", [])
        for i, ws in enumerate(wprefix):
            target = rprefix[i] if i < len(rprefix) else r.get("items", True)
            issues += self.accepts(ws, target, f"{path}[{i}]")
        if "items" in w or "items" in r:
            witems = w.get("items", True)
            ritems = r.get("items", True)
            if witems is True and ritems is not True:
                issues.append(Incompatibility("type", f"{path}[]", f"any -> {ritems}"))
            elif witems is not False:
                issues += self.accepts(witems, ritems, f"{path}[]")
        return issues


def _constraining(schema: dict[str, Any]) -> bool:
    return any(k not in ANNOTATIONS and k != "default" for k in schema)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _bound(schema: dict[str, Any], inclusive: str, exclusive: str) -> tuple[float, bool] | None:
    values: list[tuple[float, bool]] = []
    if isinstance(schema.get(inclusive), int | float):
        values.append((schema[inclusive], False))
    if isinstance(schema.get(exclusive), int | float):
        values.append((schema[exclusive], True))
    return values[0] if len(values) == 1 else (max(values) if values else None)


def _constraints(w: dict[str, Any], r: dict[str, Any], path: str) -> list[Incompatibility]:
    issues: list[Incompatibility] = []
    for inclusive, exclusive in _LOWER:
        rb, wb = _bound(r, inclusive, exclusive), _bound(w, inclusive, exclusive)
        if rb is not None and (
            wb is None or wb[0] < rb[0] or (wb[0] == rb[0] and rb[1] and not wb[1])
        ):
            issues.append(Incompatibility("constraint", path, f"lower bound {wb} -> {rb}"))
    for inclusive, exclusive in _UPPER:
        rb, wb = _bound(r, inclusive, exclusive), _bound(w, inclusive, exclusive)
        if rb is not None and (
            wb is None or wb[0] > rb[0] or (wb[0] == rb[0] and rb[1] and not wb[1])
        ):
            issues.append(Incompatibility("constraint", path, f"upper bound {wb} -> {rb}"))
    for key in _MIN_COUNTS:
        if key in r and (key not in w or w[key] < r[key]):
            issues.append(Incompatibility("constraint", path, f"{key} {w.get(key)} -> {r[key]}"))
    for key in _MAX_COUNTS:
        if key in r and (key not in w or w[key] > r[key]):
            issues.append(Incompatibility("constraint", path, f"{key} {w.get(key)} -> {r[key]}"))
    for key in _EXACT:
        if key in r and w.get(key) != r[key]:
            issues.append(
                Incompatibility("constraint", path, f"{key} {w.get(key)!r} -> {r[key]!r}")
            )
    return issues


def reader_accepts(writer: dict[str, Any], reader: dict[str, Any]) -> list[Incompatibility]:
    """Every way a reader with schema ``reader`` would reject data written with ``writer``."""
    return _Comparer(writer, reader).accepts(writer, reader, "")


def compare_versions(
    old: dict[str, Any], new: dict[str, Any], mode: str
) -> list[tuple[Direction, Incompatibility]]:
    """The incompatibilities of ``new`` against ``old`` under ``mode``, with their direction."""
    found: list[tuple[Direction, Incompatibility]] = []
    if mode in ("backward", "full"):
        found += [("backward", i) for i in reader_accepts(old, new)]
    if mode in ("forward", "full"):
        found += [("forward", i) for i in reader_accepts(new, old)]
    return found
