"""The node script every backend runs: envs byte for byte, secrets masked in the output."""

from __future__ import annotations

import subprocess

from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.spec import load_task


def _node(tmp_path, run: str, secrets: dict[str, str], envs: dict[str, str] | None = None):
    (tmp_path / "env.sh").write_text(jobscript.exports({
        **(envs or {}), **({"AIRFLOW_SKYPILOT_SECRET_NAMES": " ".join(secrets)}
                           if secrets else {})}))
    if secrets:
        (tmp_path / "secrets.sh").write_text(jobscript.exports(secrets))
    (tmp_path / "run.sh").write_text(run)
    (tmp_path / "node.sh").write_text(jobscript.node_script(
        job_dir=str(tmp_path), workdir=str(tmp_path / "w"), rank_var="RANK", has_setup=False,
        has_run=True))
    return subprocess.run(["bash", str(tmp_path / "node.sh"), "run"], capture_output=True,
                          text=True, env={"RANK": "1", "PATH": "/usr/bin:/bin"})


def test_secret_values_are_masked_in_the_output_and_the_exit_code_kept(tmp_path):
    proc = _node(tmp_path, 'echo "a=$TOKEN b"; echo "$MULTI"; echo "$TOKEN" >&2; exit 3\n',
                 {"TOKEN": "hf_$(rm)'x\"y", "MULTI": "first-line\nsecond-line"})
    assert proc.returncode == 3
    assert proc.stdout == "a=*** b\n***\n***\n***\n"


def test_without_secrets_the_script_runs_directly(tmp_path):
    proc = _node(tmp_path, 'echo "rank=$SKYPILOT_NODE_RANK v=$V"; exit 4\n', {},
                 {"V": "a b\n'c'"})
    assert proc.returncode == 4
    assert proc.stdout == "rank=1 v=a b\n'c'\n"


def test_secret_names_travel_in_the_env_but_never_values():
    task = load_task({"secrets": {"TOKEN": "s3cr3t"}, "envs": {"A": "1"}, "run": "x"})
    env = jobscript.skypilot_env(task, task_id="t", num_gpus_per_node=0, cluster_info={})
    assert env["AIRFLOW_SKYPILOT_SECRET_NAMES"] == "TOKEN"
    assert "s3cr3t" not in repr(env)


def test_job_names_are_deterministic_short_and_dns_safe():
    a = jobscript.job_name("My DAG!", "train_step", "manual__2026-01-01T00:00:00+00:00", 2, 1)
    assert a == jobscript.job_name("My DAG!", "train_step",
                                   "manual__2026-01-01T00:00:00+00:00", 2, 1)
    assert a.startswith("sky-my-dag-train-step-") and a.endswith("-t2-a1")
    assert len(jobscript.job_name("d" * 200, "t" * 200, "r", 1, 10)) <= 63
    assert jobscript.job_name("d", "t", "r1", 1) != jobscript.job_name("d", "t", "r2", 1)


def test_a_secret_in_a_shell_word_is_a_reference_expanded_on_the_node():
    """SkyPilot fills secrets into file_mounts: a mount's path in a generated script names
    the secret, and bash gives back the text exactly (quotes and all)."""
    secrets = {"KEY": "s3cr3t'$(x)", "SHORT": "s3", "EMPTY": ""}
    for text in ["s3://team-s3cr3t'$(x)/data", "s3cr3t'$(x)", "/a b/s3cr3t'$(x)s3cr3t'$(x)",
                 "no secret here", "", "s3://s3/x"]:
        word = jobscript.node_word(text, secrets)
        assert "s3cr3t" not in word
        done = subprocess.run(["bash", "-c", f"printf %s {word}"], capture_output=True,
                              text=True, env={"KEY": secrets["KEY"], "SHORT": "s3",
                                              "PATH": "/usr/bin:/bin"}, timeout=10)
        assert done.returncode == 0 and done.stdout == text, (text, word, done.stderr)
    # every occurrence, even of a short value inside other text: expanded, it is the same
    assert jobscript.node_word("s3://s3/x", secrets) == '"${SHORT}"://"${SHORT}"/x'
    assert jobscript.node_word("plain", {}) == "plain"


def test_a_task_repr_masks_a_secret_filled_into_its_mounts():
    task = load_task({"run": "x", "secrets": {"K": None},
                      "file_mounts": {"/d-$K": "s3://team-$K/data"}}, secrets={"K": "s3cr3tv"})
    assert task.file_mounts == {"/d-s3cr3tv": "s3://team-s3cr3tv/data"}  # as SkyPilot fills
    assert "s3cr3tv" not in repr(task) and "s3://team-***/data" in repr(task)


def test_secrets_and_envs_named_like_the_scripts_variables_reach_the_users_code(tmp_path):
    """node.sh sources the task's envs and secrets: its own variables are AIRFLOW_SKYPILOT_*
    (a secret named JOB_DIR made it run $JOB_DIR/run.sh, which does not exist)."""
    proc = _node(tmp_path, 'echo "$JOB_DIR|$script|$ROOT"\n',
                 {"JOB_DIR": "jd-value", "script": "sc-value"}, envs={"ROOT": "rt-value"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "***|***|rt-value\n"  # secrets masked in the output, as ever
    proc = _node(tmp_path, 'test "$JOB_DIR/$script" = jd-value/sc-value && echo intact\n',
                 {"JOB_DIR": "jd-value", "script": "sc-value"})
    assert proc.stdout == "intact\n", proc.stderr
