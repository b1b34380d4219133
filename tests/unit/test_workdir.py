"""The one rule for what a workdir ships: all but .git and what .skyignore lists."""

from __future__ import annotations

from airflow_skypilot.backends.common.workdir import ignore_patterns, is_ignored


def test_skyignore_lines_plus_git(tmp_path):
    (tmp_path / ".skyignore").write_text("# data stays home\n\ndata/\n*.ckpt\n")
    patterns = ignore_patterns(str(tmp_path))
    assert patterns == [".git", "data/", "*.ckpt"]
    assert is_ignored(".git", patterns)
    assert is_ignored("data", patterns)  # a trailing slash names the directory
    assert is_ignored("runs/last.ckpt", patterns)  # basename match at any depth
    assert not is_ignored("train.py", patterns)
    assert not is_ignored("src/data.py", patterns)


def test_without_skyignore_only_git_is_left_out(tmp_path):
    assert ignore_patterns(str(tmp_path)) == [".git"]
    assert not is_ignored("anything/at/all.py", [".git"])
