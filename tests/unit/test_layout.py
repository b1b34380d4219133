"""The package stays readable: no module over ~600 lines (the roadmap's bound)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_skypilot"
LIMIT = 600


def test_no_module_is_over_the_limit():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert sizes, "the scan found the package"
    over = {name: n for name, n in sizes.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines: {over}"
