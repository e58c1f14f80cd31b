"""The Grafana dashboard in ``examples/grafana`` queries only metrics an app exports: every
metric name in its PromQL expressions (panels and variables) is among those ``/metrics``
serves, scraped from a running app and read with the Prometheus text parser."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from eventflow import App, Event, subscribe
from eventflow.metrics import names

DASHBOARD = Path(__file__).parents[2] / "examples" / "grafana" / "eventflow.json"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_METRIC = re.compile(r"(?<![\w:])eventflow_[A-Za-z0-9_:]*")


class Beat(Event, type="it.grafana.beat"):
    n: int


def _expressions(node: Any) -> list[str]:
    """Every PromQL expression in the dashboard: targets' ``expr``, variables' ``query``."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, dict) and "query" in value:
                found.append(str(value["query"]))
            else:
                found.extend(_expressions(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(_expressions(item))
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (label values in quotes left out)."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def test_the_name_parser_reads_selectors_and_ignores_label_values() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(eventflow_a_bucket{group=~"eventflow_x"}'
        "[5m]))) / eventflow_b"
    )
    assert metric_names(expr) == {"eventflow_a_bucket", "eventflow_b"}


async def test_every_metric_the_dashboard_queries_is_exported(broker_url: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = _expressions(dashboard)
    assert len(expressions) >= 20, "the dashboard's panels were not found"
    queried: set[str] = set()
    for expr in expressions:
        found = metric_names(expr)
        assert found, f"no eventflow metric in {expr!r}"
        queried |= found

    @subscribe("it.grafana.beat", group="grafana")
    async def handle(event: Beat) -> None: ...

    async with App(
        "it-grafana", broker=broker_url, handlers=[handle], http_port=0, http_host="127.0.0.1"
    ) as app:
        assert app.http_address is not None
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{app.http_address[1]}/metrics")
    exported: set[str] = set()
    samples: set[str] = set()
    for family in text_string_to_metric_families(response.text):
        # A family with no series yet (no saga, no projection here) still names itself.
        exported.add(family.name + ("_total" if family.type == "counter" else ""))
        samples.update(s.name for s in family.samples)
    exported |= samples
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    # What is served is what eventflow.metrics.names lists (and the docs follow).
    assert samples <= names.EXPORTED, sorted(samples - names.EXPORTED)
