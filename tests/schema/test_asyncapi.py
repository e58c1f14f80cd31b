"""``eventflow schema asyncapi`` writes documents valid against the AsyncAPI 3.0.0 schema."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel
from schema_support import run_cli

from eventflow import App, Context, Envelope, Event, Saga, step, subscribe, upcaster
from eventflow.schema import build_asyncapi

SPEC = Path(__file__).parent / "asyncapi_spec" / "asyncapi-3.0.0.json"


@cache
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SPEC.read_text())
    return jsonschema.Draft7Validator(schema)


def errors(doc: dict[str, Any]) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator().iter_errors(doc)]


class Money(BaseModel):
    amount: int
    currency: Literal["EUR", "USD"]


class InvoiceIssuedV1(Event, type="schema.asyncapi.invoice", version=1):
    number: str


class InvoiceIssued(Event, type="schema.asyncapi.invoice", version=2):
    """An invoice was issued."""

    number: str
    total: Money
    lines: list[Money] = []
    note: str | None = None


@upcaster("schema.asyncapi.invoice", from_version=1)
def _invoice_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "total": {"amount": 0, "currency": "EUR"}}


class Paid(Event, type="schema.asyncapi.paid"):
    number: str


@subscribe("schema.asyncapi.invoice", group="billing")
async def on_invoice(event: InvoiceIssued, ctx: Context) -> None:
    """Handle invoices."""


@subscribe("schema.asyncapi.>", group="audit")
async def on_any(env: Envelope) -> None:
    """Audit everything."""


def test_document_of_an_app_is_valid_asyncapi_3() -> None:
    app = App("billing", handlers=[on_invoice, on_any])
    doc = build_asyncapi(app, version="2.1.0")

    assert errors(doc) == []
    assert doc["asyncapi"] == "3.0.0" and doc["info"]["version"] == "2.1.0"
    addresses = {c["address"] for c in doc["channels"].values()}
    assert addresses == {"schema.asyncapi.invoice", "schema.asyncapi.>"}
    receive = [op for op in doc["operations"].values() if op["action"] == "receive"]
    assert {op["x-eventflow-group"] for op in receive} == {"billing", "audit"}
    messages = doc["components"]["messages"]
    assert {"schema.asyncapi.invoice.v1", "schema.asyncapi.invoice.v2"} <= set(messages)
    payload = messages["schema.asyncapi.invoice.v2"]["payload"]
    assert payload["properties"]["version"]["const"] == 2
    assert payload["properties"]["data"] == {
        "$ref": "#/components/schemas/schema.asyncapi.invoice.v2"
    }
    schemas = doc["components"]["schemas"]
    total = schemas["schema.asyncapi.invoice.v2"]["properties"]["total"]
    assert total["$ref"] == "#/components/schemas/schema.asyncapi.invoice.v2.Money"
    assert "schema.asyncapi.invoice.v2.Money" in schemas
    assert "$defs" not in json.dumps(doc)  # every reference resolves inside the document


def test_the_validator_does_reject_a_broken_document() -> None:
    doc = build_asyncapi(App("billing", handlers=[on_invoice]))
    next(iter(doc["operations"].values()))["action"] = "publish"  # AsyncAPI 2 wording
    del doc["info"]["title"]
    assert len(errors(doc)) >= 2


def test_cli_writes_the_shop_document(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    out = tmp_path / "asyncapi.json"
    root = str(Path(__file__).parents[2])

    result = run_cli(
        "schema",
        "asyncapi",
        "--app",
        "examples.shop.inventory:app",
        "--app-dir",
        root,
        "--output",
        str(out),
    )

    assert result.code == 0, result.err
    doc = json.loads(out.read_text())
    assert errors(doc) == []
    assert sorted(c["address"] for c in doc["channels"].values()) == [
        "shop.shipping.shipped",
        "shop.stock.release",
        "shop.stock.reserve",
    ]
    assert "shop.stock.reserved.v2" in doc["components"]["messages"]


class ApiTripRequested(Event, type="schema.asyncapi.trip.requested"):
    """Starts the trip saga."""

    trip_id: str


class ApiBookHotel(Event, type="schema.asyncapi.hotel.book"):
    """The command of the hotel step."""

    trip_id: str


class ApiCancelHotel(Event, type="schema.asyncapi.hotel.cancel"):
    """The hotel step's compensation."""

    trip_id: str


class ApiHotelBooked(Event, type="schema.asyncapi.hotel.booked"):
    """The hotel's reply."""

    trip_id: str


class ApiTrip(Saga, name="schema.asyncapi.trip", start=ApiTripRequested, key="trip_id"):
    """One step with a compensation, both annotated with their command's class."""

    trip_id: str = ""

    def started(self, e: ApiTripRequested) -> None:
        self.trip_id = e.trip_id

    @step(reply=ApiHotelBooked, timeout=30.0)
    def hotel(self) -> ApiBookHotel:
        return ApiBookHotel(trip_id=self.trip_id)

    @hotel.compensate
    def cancel_hotel(self) -> ApiCancelHotel:
        return ApiCancelHotel(trip_id=self.trip_id)


def test_document_names_its_servers_and_the_commands_its_sagas_send() -> None:
    app = App(
        "trips", broker="nats://u:secret@10.0.0.1:4222,10.0.0.2:4222?stream=T", sagas=[ApiTrip]
    )
    doc = build_asyncapi(app)
    assert errors(doc) == []
    servers = doc["servers"]
    assert {s["host"] for s in servers.values()} == {"10.0.0.1:4222", "10.0.0.2:4222"}
    assert {s["protocol"] for s in servers.values()} == {"nats"}
    assert "secret@" not in json.dumps(doc) and "u:secret" not in json.dumps(doc)
    send = {op["channel"]["$ref"] for op in doc["operations"].values() if op["action"] == "send"}
    assert send == {
        "#/channels/schema.asyncapi.hotel.book",
        "#/channels/schema.asyncapi.hotel.cancel",
    }
    assert doc["channels"]["schema.asyncapi.hotel.book"]["address"] == "schema.asyncapi.hotel.book"
    memory = build_asyncapi(App("local"))["servers"]
    assert [s["protocol"] for s in memory.values()] == ["memory"]
