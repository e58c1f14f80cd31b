"""Each breaking change class under each mode: the rule, the field, the exit code.

The changes go from v1 (name: str, qty: int, color: red|green|blue, note: str|None = None)
to a v2. Without an upcaster every v2 also fails ``no-upcast-path`` (the runtime upcasts
version by version), so the matrix checks which *compatibility* rule fires on top of it;
with an identity upcaster, the matching safe change passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from schema_support import Project, v1, v2

MODES = ("backward", "forward", "full", "none")

SAME = """    name: str
    qty: int
    color: Literal["red", "green", "blue"]
    note: str | None = None"""

# change -> (v2 body, the field named, {mode: rules expected besides no-upcast-path})
BREAKING = {
    "field removed": (
        SAME.replace("    name: str\n", ""),
        "name",
        {"forward": {"field-removed"}, "full": {"field-removed"}},
    ),
    "type changed": (
        SAME.replace("qty: int", "qty: str"),
        "qty",
        {b: {"type-changed"} for b in ("backward", "forward", "full")},
    ),
    "required field added without default": (
        SAME + "\n    customer: str",
        "customer",
        {"backward": {"required-field-added"}, "full": {"required-field-added"}},
    ),
    "enum value removed": (
        SAME.replace('"red", "green", "blue"', '"red", "green"'),
        "color",
        {"backward": {"enum-value-removed"}, "full": {"enum-value-removed"}},
    ),
}

# change -> (v2 body, {mode: rules expected with an identity upcaster}; absent = passes)
SAFE = {
    "optional field removed": (SAME.replace("    note: str | None = None", ""), {}),
    "int widened to float": (
        SAME.replace("qty: int", "qty: float"),
        {"forward": {"type-changed"}, "full": {"type-changed"}},
    ),
    "field added with a default": (SAME + "\n    customer: str = 'anonymous'", {}),
    "enum value added": (
        SAME.replace('"blue"', '"blue", "black"'),
        {"forward": {"enum-value-added"}, "full": {"enum-value-added"}},
    ),
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    return Project(tmp_path, monkeypatch)


def _publish_v1_then(project: Project, source: str) -> None:
    project.write(v1())
    assert project.cli("export").code == 0
    project.write(source)
    exported = project.cli("export")
    assert exported.code == 0, exported.text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", sorted(BREAKING))
def test_breaking_change_without_upcaster(project: Project, change: str, mode: str) -> None:
    body, field, expected = BREAKING[change]
    _publish_v1_then(project, v2(body, mode))

    result = project.cli("check", "--json")

    assert result.code == 1
    rules = project.rules(result)
    assert rules == expected.get(mode, set()) | {"no-upcast-path"}
    for problem in result.json()["problems"]:
        if problem["rule"] in expected.get(mode, set()):
            assert problem["type"] == project.type
            assert problem["version"] == 2 and problem["against"] == 1
            assert problem["path"] == field
            assert field in problem["message"] and problem["hint"]
    text = project.cli("check")
    assert text.code == 1
    assert f"error: {project.type} v1: v1 events cannot be read as v2" in text.err
    for rule in expected.get(mode, set()):
        assert f"error: {project.type} v2 field {field!r}: not " in text.err
        assert f"[{rule}]" in text.err
    assert "schema check FAILED" in text.err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", sorted(SAFE))
def test_safe_change_with_identity_upcaster(project: Project, change: str, mode: str) -> None:
    body, expected = SAFE[change]
    _publish_v1_then(project, v2(body, mode, upcast="return data"))

    result = project.cli("check", "--json")

    assert project.rules(result) == expected.get(mode, set())
    assert result.code == (1 if expected.get(mode) else 0)
    if not expected.get(mode):
        assert result.json()["summary"]["examples"] >= 2  # the upcaster was run on examples


@pytest.mark.parametrize(
    ("body", "upcast", "field"),
    [
        (BREAKING["type changed"][0], "return data", "qty"),
        (BREAKING["required field added without default"][0], "return data", "customer"),
        (BREAKING["enum value removed"][0], "return data", "color"),
    ],
)
def test_identity_upcaster_over_a_breaking_change_fails_the_proof(
    project: Project, body: str, upcast: str, field: str
) -> None:
    _publish_v1_then(project, v2(body, upcast=upcast))

    result = project.cli("check", "--json")

    assert result.code == 1
    problems = [p for p in result.json()["problems"] if p["severity"] == "error"]
    assert [p["rule"] for p in problems] == ["upcaster-invalid-output"]
    assert problems[0]["path"] == field and problems[0]["version"] == 1
    assert "v2 rejects" in problems[0]["message"]


@pytest.mark.parametrize(
    ("body", "upcast"),
    [
        (
            BREAKING["type changed"][0],
            "return {**data, 'qty': str(data['qty'])}",
        ),
        (
            BREAKING["required field added without default"][0],
            "return {**data, 'customer': 'unknown'}",
        ),
        (
            BREAKING["enum value removed"][0],
            "return {**data, 'color': 'green' if data['color'] == 'blue' else data['color']}",
        ),
    ],
)
def test_a_real_migration_makes_the_breaking_change_pass(
    project: Project, body: str, upcast: str
) -> None:
    _publish_v1_then(project, v2(body, upcast=upcast))

    result = project.cli("check")

    assert result.code == 0, result.text
    assert "schema check passed" in result.out


def test_forward_mode_is_not_excused_by_an_upcaster(project: Project) -> None:
    body = BREAKING["field removed"][0]
    _publish_v1_then(project, v2(body, "forward", upcast="return data"))

    result = project.cli("check", "--json")

    assert project.rules(result) == {"field-removed"}
    (problem,) = result.json()["problems"]
    assert problem["direction"] == "forward"
    assert "run no upcaster" in problem["hint"]
