"""Checks of an ``App``'s configuration, made when it is built: each names what is wrong
and what to change."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ..errors import ConfigurationError
from ..patterns import overlap
from ..projections import Projection
from ..sagas.runtime import DEFAULT_CATCH_UP_LIMIT
from ..subscribe import HandlerSpec

__all__ = ["check_catch_up_limit", "check_groups", "checked_projections"]


def check_catch_up_limit(catch_up_limit: object) -> None:
    """Refuse a ``catch_up_limit`` that is not a finite number of seconds above 0."""
    if (
        isinstance(catch_up_limit, bool)
        or not isinstance(catch_up_limit, int | float)
        or not 0 < catch_up_limit < math.inf
    ):
        raise ConfigurationError(
            f"catch_up_limit must be a number of seconds above 0, got {catch_up_limit!r}; "
            f"keep it above the broker's failover time (the default is "
            f"{DEFAULT_CATCH_UP_LIMIT:g})"
        )


def checked_projections(projections: Iterable[object]) -> tuple[Projection, ...]:
    """``projections`` as a tuple, refusing what is not a ``Projection`` and two that share
    a name (names identify checkpoints)."""
    checked: list[Projection] = []
    for p in projections:
        if not isinstance(p, Projection):
            raise ConfigurationError(
                f"projections= takes Projection instances, got {p!r}: pass StockLevels()"
            )
        checked.append(p)
    names = [p.name for p in checked]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigurationError(
            f"two projections are named {', '.join(map(repr, dupes))}; names identify "
            "checkpoints, give each projection its own name="
        )
    return tuple(checked)


def check_groups(bindings: Iterable[tuple[HandlerSpec, str]]) -> None:
    """Refuse two handlers in one group whose topic patterns overlap (one would take the
    other's messages)."""
    seen: list[tuple[str, HandlerSpec]] = []
    for spec, group in bindings:
        for other_group, other in seen:
            if group == other_group and overlap(spec.pattern, other.pattern):
                raise ConfigurationError(
                    f"handlers {other.name} ({other.pattern!r}) and {spec.name} "
                    f"({spec.pattern!r}) are in the same group {group!r} with overlapping "
                    "patterns, so one would take the other's messages; give one of them "
                    "its own group="
                )
        seen.append((group, spec))
