"""The compatibility rules on pydantic-generated JSON Schemas, direction by direction."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from eventflow.schema import compare_versions, reader_accepts
from eventflow.schema.contract import contract_diff


def schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(mode="validation")


def rules(old: type[BaseModel], new: type[BaseModel], mode: str) -> set[tuple[str, str, str]]:
    found = compare_versions(schema(old), schema(new), mode)
    return {(direction, issue.rule(direction), issue.path) for direction, issue in found}


class Address(BaseModel):
    street: str
    zip: str


class AddressV2(BaseModel):
    street: str
    zip: int


class Customer(BaseModel):
    name: str
    address: Address


class CustomerV2(BaseModel):
    name: str
    address: AddressV2


def test_nested_model_type_change_is_found_through_refs() -> None:
    assert rules(Customer, CustomerV2, "full") == {
        ("backward", "type-changed", "address.zip"),
        ("forward", "type-changed", "address.zip"),
    }


def test_renaming_a_nested_model_is_not_a_change() -> None:
    class Place(BaseModel):
        street: str
        zip: str

    class Renamed(BaseModel):
        name: str
        address: Place

    assert rules(Customer, Renamed, "full") == set()
    assert contract_diff(schema(Customer), schema(Renamed)) == []


def test_int_to_float_widens_backward_and_narrows_forward() -> None:
    class A(BaseModel):
        n: int

    class B(BaseModel):
        n: float

    assert rules(A, B, "backward") == set()
    assert rules(A, B, "forward") == {("forward", "type-changed", "n")}
    assert rules(B, A, "backward") == {("backward", "type-changed", "n")}


def test_nullable_added_and_removed() -> None:
    class A(BaseModel):
        n: int

    class B(BaseModel):
        n: int | None

    assert rules(A, B, "full") == {("forward", "nullable-added", "n")}
    assert rules(B, A, "full") == {("backward", "nullable-removed", "n")}


def test_closed_model_makes_a_removed_field_break_backward() -> None:
    class Open(BaseModel):
        a: str
        b: str

    class Closed(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: str

    class OpenSmall(BaseModel):
        a: str

    assert rules(Open, OpenSmall, "backward") == set()  # extra fields are ignored
    assert rules(Open, Closed, "backward") == {("backward", "field-removed", "b")}


def test_closed_old_reader_breaks_forward_on_an_added_field() -> None:
    class Closed(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: str

    class Bigger(BaseModel):
        model_config = ConfigDict(extra="forbid")
        a: str
        b: str = ""

    assert rules(Closed, Bigger, "forward") == {("forward", "field-added", "b")}
    assert rules(Closed, Bigger, "backward") == set()


def test_optional_made_required_and_back() -> None:
    class Optional_(BaseModel):
        a: str = "x"

    class Required(BaseModel):
        a: str

    assert rules(Optional_, Required, "backward") == {("backward", "field-made-required", "a")}
    assert rules(Required, Optional_, "forward") == {("forward", "field-made-optional", "a")}


def test_python_enum_values() -> None:
    class Color(StrEnum):
        RED = "red"
        BLUE = "blue"

    class Fewer(StrEnum):
        RED = "red"

    class A(BaseModel):
        c: Color

    class B(BaseModel):
        c: Fewer

    assert rules(A, B, "full") == {("backward", "enum-value-removed", "c")}
    assert rules(B, A, "full") == {("forward", "enum-value-added", "c")}


def test_open_string_narrowed_to_a_literal() -> None:
    class A(BaseModel):
        c: str

    class B(BaseModel):
        c: Literal["a", "b"]

    assert rules(A, B, "backward") == {("backward", "enum-value-removed", "c")}
    assert rules(A, B, "forward") == set()


def test_constraints_tightened_and_loosened() -> None:
    class A(BaseModel):
        n: int = Field(ge=0)
        s: str = Field(max_length=10)

    class B(BaseModel):
        n: int = Field(ge=1)
        s: str = Field(max_length=20)

    assert rules(A, B, "backward") == {("backward", "constraint-tightened", "n")}
    assert rules(A, B, "forward") == {("forward", "constraint-loosened", "s")}


def test_lists_dicts_and_unions() -> None:
    class A(BaseModel):
        items: list[int]
        tags: dict[str, str]
        either: int | str

    class B(BaseModel):
        items: list[str]
        tags: dict[str, int]
        either: int

    assert rules(A, B, "backward") == {
        ("backward", "type-changed", "items[]"),
        ("backward", "type-changed", "tags.*"),
        ("backward", "type-changed", "either"),
    }


def test_recursive_models_terminate() -> None:
    class Node(BaseModel):
        value: int
        children: list[Node] = []

    assert reader_accepts(schema(Node), schema(Node)) == []


def test_none_mode_checks_nothing() -> None:
    class A(BaseModel):
        n: int

    class B(BaseModel):
        n: str

    assert rules(A, B, "none") == set()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"default": 3}, "field 'n': default (absent) -> 3"),
        ({"title": "A number"}, None),
        ({"description": "documented"}, None),
    ],
)
def test_contract_diff_ignores_annotations_only(
    change: dict[str, Any], expected: str | None
) -> None:
    old = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": []}
    new = {"type": "object", "properties": {"n": {"type": "integer", **change}}, "required": []}
    assert contract_diff(old, new) == ([expected] if expected else [])


def test_contract_diff_names_required_changes_by_field() -> None:
    old = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    new = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": []}
    assert contract_diff(old, new) == ["field 'n': no longer required"]
