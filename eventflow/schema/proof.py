"""Upcaster proof: run each upcaster chain on example payloads, validate against the latest.

For an older version ``v`` of a type, the examples of ``v``'s schema (its own ``examples``
and generated ones, see :mod:`eventflow.schema.examples`) are upcast along ``v -> ... ->
latest`` with the code's upcasters, and the result is validated by the latest model exactly
as a consumer would. A chain that raises or returns data the latest model rejects fails CI
here instead of dead-lettering stored events in production.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pydantic import ValidationError

from ..errors import UpcastError
from ..events import EventRegistry
from .examples import examples_for
from .report import Problem

__all__ = ["prove_upcasters"]


def prove_upcasters(
    registry: EventRegistry,
    event_type: str,
    version: int,
    schema: dict[str, Any],
    latest: int,
) -> tuple[list[Problem], int]:
    """Prove the chain from ``version`` to ``latest``; return the problems and examples run.

    ``schema`` is ``version``'s schema (committed or from code). When the code still has
    the ``version`` class, generated examples it rejects are dropped and the schema's own
    examples must pass it.
    """
    problems: list[Problem] = []

    def problem(rule: str, path: str, message: str, hint: str, warning: bool = False) -> None:
        problems.append(
            Problem(
                "warning" if warning else "error", rule, event_type, version, path, message, hint
            )
        )

    raw_own = schema.get("examples")
    own = len(raw_own) if isinstance(raw_own, list) else 0
    model = registry.get(event_type, version) if version in registry.types()[event_type] else None
    examples: list[Any] = []
    for n, example in enumerate(examples_for(schema), 1):
        if model is not None:
            try:
                model.__pydantic_validator__.validate_python(copy.deepcopy(example))
            except ValidationError as exc:
                if n <= own:
                    problem(
                        "example-invalid",
                        _loc(exc),
                        f"example #{n} does not validate as v{version}: {_errors(exc)}",
                        "fix the example in the model's json_schema_extra",
                    )
                continue
        examples.append(example)
    if not examples:
        problem(
            "no-examples",
            "",
            f"no example payload of v{version} could be made to prove its upcasters",
            "add examples: model_config = ConfigDict(json_schema_extra={'examples': [...]})",
            warning=True,
        )
        return problems, 0
    target = registry.get(event_type, latest)
    chain = " -> ".join(f"v{v}" for v in range(version, latest + 1))
    for n, example in enumerate(examples, 1):
        shown = _short(example)
        try:
            data = registry.upcast(event_type, copy.deepcopy(example), version, latest)
        except UpcastError as exc:
            problem(
                "upcaster-failed",
                "",
                f"upcasting example #{n} {shown} ({chain}) failed: {exc}",
                "make the upcaster handle every valid payload of its version",
            )
            return problems, n
        try:
            target.__pydantic_validator__.validate_python(data)
        except ValidationError as exc:
            problem(
                "upcaster-invalid-output",
                _loc(exc),
                f"upcasting example #{n} {shown} ({chain}) gives {_short(data)}, which "
                f"v{latest} rejects: {_errors(exc)}",
                f"fix the upcasters of this chain so their output validates as v{latest}",
            )
            return problems, n
    return problems, len(examples)


def _loc(exc: ValidationError) -> str:
    return ".".join(str(p) for p in exc.errors()[0]["loc"])


def _errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."
