"""Generated example payloads: valid for their own schema, covering enums and unions."""

from __future__ import annotations

from datetime import datetime
from typing import Literal
from uuid import UUID

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from eventflow.schema import examples_for


class Line(BaseModel):
    sku: str = Field(min_length=3)
    qty: int = Field(gt=0, le=5)


class Order(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{"id": "given", "lines": []}]})

    id: str
    at: datetime | None = None
    ref: UUID | None = None
    lines: list[Line]
    status: Literal["new", "paid", "shipped"] = "new"
    amount: int | float = 0
    meta: dict[str, str] = {}


def test_examples_validate_against_the_schema_and_the_model() -> None:
    schema = Order.model_json_schema()
    examples = examples_for(schema)
    assert examples[0] == {"id": "given", "lines": []}  # the schema's own first
    validator = jsonschema.Draft202012Validator(schema, format_checker=None)
    for example in examples:
        validator.validate(example)
        Order.model_validate(example)


def test_examples_cover_every_enum_value_and_union_branch() -> None:
    examples = examples_for(Order.model_json_schema())
    assert {e.get("status") for e in examples} >= {"new", "paid", "shipped"}
    amounts = [e["amount"] for e in examples if "amount" in e]
    assert any(isinstance(a, int) for a in amounts) and any(isinstance(a, float) for a in amounts)
    assert any(e.get("at") is None and "at" in e for e in examples) or any(
        "at" not in e for e in examples
    )
    assert any(isinstance(e.get("at"), str) for e in examples)
    assert len(examples) <= 2 * 12 + 1
