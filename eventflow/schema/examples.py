"""Example payloads for a JSON Schema, to prove upcasters on before production does.

:func:`examples_for` returns the schema's own ``examples`` (set them with pydantic's
``model_config = ConfigDict(json_schema_extra={"examples": [...]})``), then payloads made
from the schema: one with every field, one with only the required fields (nullable ones
set to ``null``), and variants that walk through every enum value and every union branch,
so an upcaster that forgets a case fails in CI.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .contract import resolve

__all__ = ["MAX_VARIANTS", "examples_for", "generate"]

MAX_VARIANTS = 12
"""At most this many variants for enum values and union branches."""
_MAX_DEPTH = 8
_FORMATS = {
    "date-time": "2024-01-02T03:04:05Z",
    "date": "2024-01-02",
    "time": "03:04:05Z",
    "duration": "PT1S",
    "uuid": "00000000-0000-4000-8000-000000000001",
    "email": "someone@example.com",
    "uri": "https://example.com/",
    "hostname": "example.com",
    "ipv4": "192.0.2.1",
    "ipv6": "2001:db8::1",
}


class _Generator:
    def __init__(self, root: dict[str, Any], *, full: bool, pick: int) -> None:
        self.root = root
        self.full = full
        self.pick = pick
        self.width = 1  # the widest enum or union seen: how many variants are worth making

    def value(self, schema: Any, depth: int) -> Any:
        schema = resolve(schema, self.root)
        if not isinstance(schema, dict):
            return None
        given = schema.get("examples")
        if isinstance(given, list) and given and depth > 0:
            return copy.deepcopy(given[self.pick % len(given)])
        if "const" in schema:
            return copy.deepcopy(schema["const"])
        values = schema.get("enum")
        if isinstance(values, list) and values:
            self.width = max(self.width, len(values))
            return copy.deepcopy(values[self.pick % len(values)])
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list) and branches:
            return self._branch(branches, depth)
        declared = schema.get("type")
        if isinstance(declared, list):
            kinds = [t for t in declared if t != "null"]
            if (not self.full and "null" in declared) or not kinds:
                return None
            self.width = max(self.width, len(kinds))
            declared = kinds[self.pick % len(kinds)]
        if declared is None and "properties" in schema:
            declared = "object"
        return self._typed(declared, schema, depth)

    def _branch(self, branches: list[Any], depth: int) -> Any:
        resolved = [resolve(b, self.root) for b in branches]
        nulls = [b for b in resolved if isinstance(b, dict) and b.get("type") == "null"]
        others = [b for b in resolved if not (isinstance(b, dict) and b.get("type") == "null")]
        if (not self.full and nulls) or not others or (depth >= _MAX_DEPTH and nulls):
            return None
        self.width = max(self.width, len(others))
        return self.value(others[self.pick % len(others)], depth + 1)

    def _typed(self, declared: Any, schema: dict[str, Any], depth: int) -> Any:
        if declared == "null":
            return None
        if declared == "boolean":
            return self.pick % 2 == 0
        if declared == "integer":
            return _number(schema, 1, integer=True)
        if declared == "number":
            return _number(schema, 1.5, integer=False)
        if declared == "string":
            return _string(schema, self.pick)
        if declared == "array":
            return self._array(schema, depth)
        if declared == "object":
            return self._object(schema, depth)
        return "value" if self.full else None

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list):
            return [self.value(item, depth + 1) for item in prefix]
        count = int(schema.get("minItems", 0))
        if self.full and depth < _MAX_DEPTH:
            count = max(count, 1)
        count = min(count, int(schema.get("maxItems", count)))
        items = schema.get("items", {})
        return [self.value(items, depth + 1) for _ in range(count)]

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        props: dict[str, Any] = schema.get("properties", {})
        required = set(schema.get("required", []))
        out: dict[str, Any] = {}
        for name, sub in props.items():
            if name in required or (self.full and depth < _MAX_DEPTH):
                out[name] = self.value(sub, depth + 1)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict) and not props and self.full and depth < _MAX_DEPTH:
            out["key"] = self.value(extra, depth + 1)
        return out


def _number(schema: dict[str, Any], preferred: float, *, integer: bool) -> int | float:
    low: float | None = None
    high: float | None = None
    step = 1 if integer else 0.5
    if isinstance(schema.get("minimum"), int | float):
        low = schema["minimum"]
    if isinstance(schema.get("exclusiveMinimum"), int | float):
        low = schema["exclusiveMinimum"] + step
    if isinstance(schema.get("maximum"), int | float):
        high = schema["maximum"]
    if isinstance(schema.get("exclusiveMaximum"), int | float):
        high = schema["exclusiveMaximum"] - step
    value = preferred
    if low is not None and value < low:
        value = low
    if high is not None and value > high:
        value = high
    multiple = schema.get("multipleOf")
    if isinstance(multiple, int | float) and multiple > 0:
        value = multiple * max(1, round(value / multiple))
    return int(value) if integer else float(value)


def _string(schema: dict[str, Any], pick: int) -> str:
    text = _FORMATS.get(str(schema.get("format", "")), f"text-{pick}")
    low = int(schema.get("minLength", 0))
    if len(text) < low:
        text = text + "x" * (low - len(text))
    high = schema.get("maxLength")
    if isinstance(high, int) and len(text) > high:
        text = text[:high]
    return text


def generate(schema: dict[str, Any], *, full: bool = True, pick: int = 0) -> Any:
    """One payload made from ``schema``: every field (``full``) or only the required ones.

    ``pick`` chooses the n-th enum value and union branch wherever there is a choice.
    """
    return _Generator(schema, full=full, pick=pick).value(schema, 0)


def examples_for(schema: dict[str, Any]) -> list[Any]:
    """The schema's own examples, then generated ones; no two alike."""
    out: list[Any] = []
    seen: set[str] = set()

    def add(value: Any) -> None:
        key = json.dumps(value, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(value)

    own = schema.get("examples")
    if isinstance(own, list):
        for example in own:
            add(copy.deepcopy(example))
    width = 1
    pick = 0
    while pick < min(width, MAX_VARIANTS):
        for full in (True, False):
            gen = _Generator(schema, full=full, pick=pick)
            add(gen.value(schema, 0))
            width = max(width, gen.width)
        pick += 1
    return out
