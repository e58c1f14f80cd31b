"""The schema registry in git: export, compatibility check, upcaster proof, AsyncAPI.

``eventflow schema export`` writes ``schemas/<type>/v<version>.json`` and ``schemas/index.json``
from the Event models; ``eventflow schema check`` fails CI when the code breaks what is
committed (see :mod:`eventflow.schema.check` for the rules); ``eventflow schema asyncapi``
documents an app's channels. ``docs/schemas.md`` walks through it.
"""

from .asyncapi import build_asyncapi
from .check import CheckReport, Problem, check_registry
from .compat import Incompatibility, compare_versions, reader_accepts
from .examples import examples_for
from .export import (
    MODES,
    ExportResult,
    Mode,
    SchemaRegistryError,
    event_schema,
    export_registry,
    select_events,
)
from .outgoing import check_outgoing

__all__ = (
    "MODES",
    "CheckReport",
    "ExportResult",
    "Incompatibility",
    "Mode",
    "Problem",
    "SchemaRegistryError",
    "build_asyncapi",
    "check_outgoing",
    "check_registry",
    "compare_versions",
    "event_schema",
    "examples_for",
    "export_registry",
    "reader_accepts",
    "select_events",
)
