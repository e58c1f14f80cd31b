"""Export and check over a registry's life: publish, evolve, remove, retire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from schema_support import Project, v1, v2

KEEP_ALL = """    name: str
    qty: int
    color: Literal["red", "green", "blue"]
    note: str | None = None
    customer: str | None = None"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    return Project(tmp_path, monkeypatch)


def test_export_is_stable_and_persists_no_import_path(project: Project) -> None:
    project.write(v2(KEEP_ALL, upcast="return {**data, 'customer': None}"))
    first = project.cli("export")
    files = {p: p.read_bytes() for p in project.registry.rglob("*.json")}

    second = project.cli("export")

    assert first.code == second.code == 0
    assert {p: p.read_bytes() for p in project.registry.rglob("*.json")} == files
    assert "0 written, 3 unchanged" in second.out
    index_text = (project.registry / "index.json").read_text()
    assert "_to_v2" not in index_text and "ThingV" not in index_text  # no Python names
    entry = json.loads(index_text)["types"][project.type]
    assert entry["compatibility"] == "backward" and entry["latest"] == 2
    assert entry["upcasters"] == [{"from_version": 1, "to_version": 2}]
    schema_text = (project.registry / project.type / "v2.json").read_text()
    assert schema_text.endswith("}\n") and '\n  "$schema"' in schema_text
    assert json.loads(schema_text)["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_changing_a_published_version_fails_check_and_export(project: Project) -> None:
    project.write(v1())
    project.cli("export")
    project.write(v1().replace("qty: int", "qty: int | None"))

    check = project.cli("check", "--json")
    export = project.cli("export")

    assert check.code == 1
    (problem,) = check.json()["problems"]
    assert problem["rule"] == "published-schema-changed"
    assert problem["path"] == "qty" and problem["version"] == 1
    assert "immutable" in problem["hint"]
    assert export.code == 1 and "published versions are immutable" in export.err
    assert project.cli("export", "--force").code == 0
    assert project.cli("check").code == 0


def test_documentation_changes_are_a_warning_only(project: Project) -> None:
    project.write(v1())
    project.cli("export")
    project.write(v1().replace("qty: int", 'qty: int = Field(description="how many")'))

    check = project.cli("check", "--json")

    assert check.code == 0
    assert [p["rule"] for p in check.json()["problems"]] == ["schema-stale"]
    assert project.cli("export").code == 0  # not a contract change: export may rewrite it


def test_unexported_version_and_missing_registry(project: Project) -> None:
    project.write(v1())
    missing = project.cli("check", "--json")
    assert missing.code == 1
    assert project.rules(missing) == {"no-registry", "unexported-version"}
    project.cli("export")
    project.write(v2(KEEP_ALL, upcast="return {**data, 'customer': None}"))

    check = project.cli("check")

    assert check.code == 1
    assert "v2 is defined in the code but not in the registry [unexported-version]" in check.err
    assert "eventflow schema export" in check.err


def test_removing_a_type_fails_unless_retired_or_allowed(project: Project) -> None:
    project.write(v1())
    project.cli("export")
    project.new_module()
    project.write(v1().replace('type="{T}"', 'type="{T}_other"'))
    other = project.type + "_other"
    project.cli("export")

    check = project.cli("check", "--json")

    assert check.code == 1
    (problem,) = [p for p in check.json()["problems"] if p["severity"] == "error"]
    assert (problem["rule"], problem["type"]) == ("type-removed", project.type)
    assert f"--retire {project.type}" in problem["hint"]
    assert project.cli("check", "--allow-removal").code == 0
    assert project.cli("export", "--retire", project.type).code == 0
    assert project.cli("check").code == 0
    assert json.loads((project.registry / "index.json").read_text())["types"][project.type][
        "retired"
    ]
    assert other in json.loads((project.registry / "index.json").read_text())["types"]


def test_removing_an_old_version_class_is_fine_while_its_upcaster_stays(
    project: Project,
) -> None:
    upcast = "return {**data, 'customer': None}"
    project.write(v2(KEEP_ALL, upcast=upcast))
    project.cli("export")
    without_v1 = v2(KEEP_ALL, upcast=upcast).replace('type="{T}", version=1', 'type="{T}_gone"')
    project.new_module()
    project.write(without_v1)

    check = project.cli("check", "--json", "--include", project.type)

    assert check.code == 0, check.out
    assert check.json()["summary"]["examples"] >= 2  # v1 proven from its committed schema


def test_removing_an_old_version_and_its_upcaster_fails(project: Project) -> None:
    project.write(v2(KEEP_ALL, upcast="return {**data, 'customer': None}"))
    project.cli("export")
    source = v2(KEEP_ALL).replace('type="{T}", version=1', 'type="{T}_gone", version=1')
    project.new_module()
    project.write(source)

    check = project.cli("check", "--json", "--include", project.type)

    assert check.code == 1
    (problem,) = [p for p in check.json()["problems"] if p["severity"] == "error"]
    assert (problem["rule"], problem["version"]) == ("version-removed", 1)
    assert f"--retire {project.type}:1" in problem["hint"]
    retire = project.cli("export", "--retire", f"{project.type}:1", "--include", project.type)
    assert retire.code == 0, retire.err
    assert project.cli("check", "--include", project.type).code == 0


def test_missing_upcaster_between_compatible_versions_says_return_data(
    project: Project,
) -> None:
    project.write(v2(KEEP_ALL))
    project.cli("export")

    check = project.cli("check", "--json")

    (problem,) = check.json()["problems"]
    assert problem["rule"] == "no-upcast-path"
    assert "`return data` is enough" in problem["hint"]
    assert f"@upcaster('{project.type}', from_version=1)" in problem["hint"]


def test_broken_upcaster_that_raises(project: Project) -> None:
    project.write(v2(KEEP_ALL, upcast="return {**data, 'customer': data['missing']}"))
    project.cli("export")

    check = project.cli("check", "--json")

    assert check.code == 1
    (problem,) = check.json()["problems"]
    assert problem["rule"] == "upcaster-failed" and "KeyError" in problem["message"]


def test_json_report_structure(project: Project) -> None:
    project.write(v2(KEEP_ALL, mode="full", upcast="return {**data, 'customer': None}"))
    project.cli("export")

    report = project.cli("check", "--json").json()

    assert report["ok"] is True
    assert set(report) == {"ok", "registry", "summary", "problems", "types"}
    assert set(report["summary"]) == {"types", "versions", "errors", "warnings", "examples"}
    assert report["types"][project.type] == {
        "compatibility": "full",
        "latest": 2,
        "versions": [1, 2],
        "upcasters": [1],
        "in_code": True,
        "retired": False,
    }


def test_usage_errors_exit_2(project: Project) -> None:
    project.write(v1())
    from schema_support import run_cli

    assert run_cli("schema", "check").code == 2
    assert run_cli("schema", "check", "--module", "no_such_module_xyz").code == 2
    assert project.cli("check", "--include", "nothing.>").code == 2
    assert bad_mode_rejected()


def bad_mode_rejected() -> bool:
    from eventflow import Event, EventTypeError

    with pytest.raises(EventTypeError, match="compatibility must be"):

        class _Bad(Event, type="schema.test.badmode", compatibility="sideways"):
            x: int

    return True


def test_mode_change_without_export_is_a_stale_index_warning(project: Project) -> None:
    project.write(v1())
    project.cli("export")
    project.write(v1(mode="full"))

    check = project.cli("check", "--json")

    assert check.code == 0
    (problem,) = check.json()["problems"]
    assert (problem["severity"], problem["rule"]) == ("warning", "schema-stale")
    assert check.json()["types"][project.type]["compatibility"] == "full"
    project.cli("export")
    assert project.cli("check", "--json").json()["problems"] == []


def test_include_limits_the_committed_types_too(project: Project) -> None:
    project.write(
        v1()
        + v1()
        .split("from eventflow import Event, upcaster")[1]
        .replace('ThingV1(Event, type="{T}"', 'OtherV1(Event, type="{T}_b"')
    )
    assert project.cli("export").code == 0
    project.new_module()
    project.write(v1())

    assert project.cli("check", "--include", project.type).code == 0
    assert project.cli("check").code == 1  # {T}_b is gone: type-removed
