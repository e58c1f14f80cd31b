"""An AsyncAPI 3.0 document of an app: its channels (subscription patterns), messages, schemas.

- one channel per ``@subscribe`` pattern, its ``address`` the pattern (NATS-style wildcards);
- one ``receive`` operation per handler, naming its consumer group;
- one message per event type and version the channel can carry; the payload is the wire
  form, the envelope, whose ``data`` is the event's JSON Schema;
- the event schemas and their nested models under ``components.schemas``, named
  ``<type>.v<version>`` and ``<type>.v<version>.<Model>``: logical names, no import paths.

- ``servers``: the app's broker (host and protocol, from its URL, without credentials);
- one ``send`` operation per saga step or compensation whose method is annotated with the
  command's class (``def reserve(self) -> ReserveStock``), on the channel of its topic.

Other types the app publishes are listed under ``components.messages`` without a channel,
because publishing is not declared ahead of time.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..events import Event, EventRegistry
from ..patterns import matches

if TYPE_CHECKING:
    from ..app import App

__all__ = ["ASYNCAPI_VERSION", "build_asyncapi", "envelope_schema"]

ASYNCAPI_VERSION = "3.0.0"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _channel_id(pattern: str) -> str:
    return _UNSAFE.sub("_", pattern.replace("*", "star").replace(">", "rest"))


def envelope_schema(data_ref: str, event_type: str, version: int) -> dict[str, Any]:
    """The JSON Schema of an envelope carrying one event type and version in ``data``."""
    text = {"type": "string"}
    return {
        "type": "object",
        "required": ["id", "type", "version", "source", "time", "data"],
        "properties": {
            "id": {**text, "description": "UUIDv7 made by eventflow (any string from others)"},
            "type": {"type": "string", "const": event_type},
            "version": {"type": "integer", "const": version},
            "source": {**text, "description": "the publishing app's name"},
            "time": {"type": "string", "format": "date-time"},
            "correlation_id": text,
            "causation_id": {"type": ["string", "null"]},
            "key": {"type": ["string", "null"], "description": "partition / ordering key"},
            "headers": {"type": "object", "additionalProperties": text},
            "data": {"$ref": data_ref},
        },
    }


def _hoist(cls: type[Event], schemas: dict[str, Any]) -> str:
    """Put ``cls``'s schema and its nested models in ``schemas``; return its name there."""
    name = f"{cls.event_type}.v{cls.event_version}"
    if name in schemas:
        return name
    template = "#/components/schemas/" + name.replace("{", "{{").replace("}", "}}") + ".{model}"
    schema = cls.model_json_schema(mode="validation", ref_template=template)
    for nested, sub in schema.pop("$defs", {}).items():
        schemas[f"{name}.{nested}"] = sub
    schemas[name] = schema
    return name


def build_asyncapi(
    app: App,
    *,
    registry: EventRegistry | None = None,
    version: str = "1.0.0",
    description: str | None = None,
) -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of ``app`` as a JSON-ready dict.

    ``registry`` (default: the app's) gives the event types; ``version`` is the document's
    ``info.version``.
    """
    reg = registry or app.registry
    all_types = reg.types()
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}

    def message(cls: type[Event]) -> str:
        name = _hoist(cls, schemas)
        if name not in messages:
            messages[name] = {
                "name": cls.event_type,
                "title": f"{cls.event_type} v{cls.event_version}",
                "summary": (cls.__doc__ or "").strip().split("\n")[0] or cls.__qualname__,
                "contentType": "application/json",
                "payload": envelope_schema(
                    f"#/components/schemas/{name}", cls.event_type, cls.event_version
                ),
                "x-eventflow-type": cls.event_type,
                "x-eventflow-version": cls.event_version,
            }
        return name

    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for spec, group, signature in app._bindings:
        channel = _channel_id(spec.pattern)
        if signature.accepts:  # typed handler: the types it takes, every version
            wanted = sorted(t for t in signature.accepts if matches(spec.pattern, t))
        else:  # Envelope or Event: whatever the registry knows on this pattern
            wanted = sorted(t for t in all_types if matches(spec.pattern, t))
        names = [message(reg.get(t, v)) for t in wanted for v in all_types.get(t, [])]
        entry = channels.setdefault(
            channel,
            {
                "address": spec.pattern,
                "description": f"topics matching {spec.pattern!r}",
                "messages": {},
            },
        )
        for name in names:
            entry["messages"][name] = {"$ref": f"#/components/messages/{name}"}
        op_id = _UNSAFE.sub("_", f"{group}.{spec.fn.__qualname__}.{channel}")
        operations[op_id] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel}"},
            "summary": f"{spec.name} in consumer group {group!r}",
            "messages": [{"$ref": f"#/channels/{channel}/messages/{n}"} for n in names],
            "x-eventflow-group": group,
            "x-eventflow-concurrency": spec.concurrency,
        }
    for saga, step, cls in _commands(app):
        channel = _channel_id(cls.event_type)
        names = [message(reg.get(cls.event_type, v)) for v in all_types.get(cls.event_type, [])]
        names = names or [message(cls)]
        entry = channels.setdefault(
            channel,
            {"address": cls.event_type, "description": f"topic {cls.event_type!r}", "messages": {}},
        )
        for name in names:
            entry["messages"][name] = {"$ref": f"#/components/messages/{name}"}
        operations[_UNSAFE.sub("_", f"send.{saga}.{step}.{channel}")] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel}"},
            "summary": f"the command of step {step!r} of saga {saga!r}",
            "messages": [{"$ref": f"#/channels/{channel}/messages/{n}"} for n in names],
        }
    for event_type, versions in all_types.items():
        for v in versions:
            message(reg.get(event_type, v))
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": app.name,
            "version": version,
            "description": description
            or f"Events of the eventflow app {app.name!r}: the envelope JSON on each topic.",
        },
        "servers": _servers(app.broker.url),
        "defaultContentType": "application/json",
        "channels": dict(sorted(channels.items())),
        "operations": dict(sorted(operations.items())),
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "messages": dict(sorted(messages.items())),
        },
    }


def _servers(url: str) -> dict[str, Any]:
    """The broker as AsyncAPI servers: one per host of its URL (no credentials)."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2].split(",") if parts.netloc else []
    hosts = [h for h in hosts if h] or [parts.path.strip("/") or "localhost"]
    description = (
        "the in-process memory broker (reachable only inside the app's process)"
        if parts.scheme == "memory"
        else f"the app's broker, {url}"
    )
    return {
        _UNSAFE.sub("_", f"broker-{i}" if len(hosts) > 1 else "broker"): {
            "host": host,
            "protocol": parts.scheme,
            "description": description,
        }
        for i, host in enumerate(hosts, 1)
    }


def _commands(app: App) -> Iterator[tuple[str, str, type[Event]]]:
    """(saga name, step or compensation name, command class) for every saga method of the
    app annotated with the concrete ``Event`` class it returns."""
    for saga_cls in app.sagas.classes:
        definition = saga_cls.definition
        for step in definition.steps:
            methods: list[Callable[..., Any]] = [step.fn]
            if step.compensation is not None:
                methods.append(step.compensation.fn)
            for fn in methods:
                try:
                    returned = typing.get_type_hints(fn).get("return")
                except Exception:  # an annotation that does not resolve: not declared
                    continue
                if not isinstance(returned, type) or not issubclass(returned, Event):
                    continue
                if returned is not Event and returned.event_type:
                    yield definition.name, fn.__name__, returned
