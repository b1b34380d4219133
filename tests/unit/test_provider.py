"""Airflow discovers the provider through its entry point, and its metadata tells the truth."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from airflow_skypilot.get_provider_info import get_provider_info

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_skypilot"
#: conf.get/getboolean/getfloat/...("skypilot", "<option>", ...), over line breaks too
CONF_READ = re.compile(r"""conf\.(?:get|has_option)\w*\(\s*["']skypilot["']\s*,\s*["'](\w+)["']""")


def _read_options() -> dict[str, list[str]]:
    """Every ``[skypilot]`` option the package reads, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for match in CONF_READ.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(match.group(1), []).append(f"{path.relative_to(PACKAGE)}:{line}")
    return found


def test_provider_info_names_the_package():
    info = get_provider_info()
    assert info["package-name"] == "airflow-skypilot"
    assert "connections" in info["config"]["skypilot"]["options"]


def test_provider_info_matches_airflows_schema():
    import jsonschema

    schema = json.loads((Path(importlib.import_module("airflow").__file__).parent
                         / "provider_info.schema.json").read_text())
    jsonschema.validate(get_provider_info(), schema)


def test_every_skypilot_option_read_is_declared_and_every_declared_one_is_read():
    read = _read_options()
    assert {"connections", "deferrable", "probe_timeout"} <= set(read), read  # the scan works
    options = get_provider_info()["config"]["skypilot"]["options"]
    undeclared = {o: where for o, where in read.items() if o not in options}
    assert not undeclared, f"read but not declared in get_provider_info: {undeclared}"
    assert not set(options) - set(read), "declared but never read"
    for name, option in options.items():
        assert {"description", "type", "default", "example", "version_added"} <= set(option), \
            name
        assert option["type"] in ("string", "boolean", "integer", "float"), name


def test_declared_defaults_are_the_code_fallbacks(monkeypatch):
    for key in [k for k in os.environ if k.startswith("AIRFLOW__SKYPILOT__")]:
        monkeypatch.delenv(key)
    from airflow_skypilot.operators.skypilot import default_connections, default_deferrable

    options = get_provider_info()["config"]["skypilot"]["options"]
    assert default_connections() == [c for c in options["connections"]["default"].split(",")
                                     if c]
    assert str(default_deferrable()) == options["deferrable"]["default"]


def _listed_modules(info: dict) -> list[str]:
    return [m for kind in ("operators", "sensors", "hooks", "triggers")
            for entry in info[kind] for m in entry["python-modules"]]


def test_every_listed_module_and_class_imports():
    info = get_provider_info()
    for module in _listed_modules(info):
        importlib.import_module(module)
    classes = ([c["hook-class-name"] for c in info["connection-types"]] + info["extra-links"])
    for path in classes:
        module, _, name = path.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type), path


@pytest.mark.parametrize("kind", ["operators", "sensors", "triggers", "hooks"])
def test_every_module_of_a_kind_is_listed(kind):
    listed = {m for entry in get_provider_info()[kind] for m in entry["python-modules"]}
    on_disk = {f"airflow_skypilot.{kind}.{p.stem}" for p in (PACKAGE / kind).glob("*.py")
               if p.stem != "__init__" and not p.stem.startswith("_")}
    assert on_disk == listed


def test_the_integration_named_by_every_entry_exists():
    info = get_provider_info()
    names = {i["integration-name"] for i in info["integrations"]}
    for kind in ("operators", "sensors", "hooks", "triggers"):
        assert {e["integration-name"] for e in info[kind]} <= names


def test_the_ui_plugin_loads_through_its_entry_point_not_the_provider_info():
    # listed in both places, eager provider discovery registers it twice (an import error)
    assert "plugins" not in get_provider_info()
    (entry,) = [e for e in metadata.entry_points(group="airflow.plugins") if e.name == "skypilot"]
    assert entry.value == "airflow_skypilot.plugins.skypilot:SkyPilotPlugin"
    assert entry.load().name == "skypilot"


def test_dependencies_cover_what_the_package_imports():
    """Third-party imports of the package are declared (pydantic, yaml...), not borrowed."""
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    declared = {re.split(r"[\[<>=!~ ]", d.strip().strip('",'))[0].lower()
                for d in deps.splitlines() if d.strip().startswith('"')}
    imported = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
    for module, dist in {"pydantic": "pydantic", "pydantic_core": "pydantic",
                         "yaml": "pyyaml"}.items():
        if module in imported:
            assert dist in declared, f"{module} is imported: declare {dist}"


def test_airflow_lists_the_provider(tmp_path):
    airflow = Path(sys.executable).parent / "airflow"
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path)}
    out = subprocess.run([str(airflow), "providers", "list", "-o", "plain"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert any(line.startswith("airflow-skypilot") for line in out.splitlines()), out
