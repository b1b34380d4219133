"""Airflow discovers the provider through its entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from airflow_skypilot.get_provider_info import get_provider_info


def test_provider_info_names_the_package():
    info = get_provider_info()
    assert info["package-name"] == "airflow-skypilot"
    assert "connections" in info["config"]["skypilot"]["options"]


def test_airflow_lists_the_provider(tmp_path):
    airflow = Path(sys.executable).parent / "airflow"
    env = {**os.environ, "AIRFLOW_HOME": str(tmp_path)}
    out = subprocess.run([str(airflow), "providers", "list", "-o", "plain"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert any(line.startswith("airflow-skypilot") for line in out.splitlines()), out
