"""The node script every backend runs: envs byte for byte, secrets masked in the output."""

from __future__ import annotations

import subprocess

import pytest

from airflow_skypilot.backends.common import jobscript
from airflow_skypilot.spec import load_task


def _node(tmp_path, run: str, secrets: dict[str, str], envs: dict[str, str] | None = None,
          path: str | None = None):
    (tmp_path / "env.sh").write_text(jobscript.exports({
        **(envs or {}), **({"AIRFLOW_SKYPILOT_SECRET_NAMES": " ".join(secrets)}
                           if secrets else {})}))
    if secrets:
        (tmp_path / "secrets.sh").write_text(jobscript.exports(secrets))
    (tmp_path / "run.sh").write_text(jobscript.user_script(run))
    (tmp_path / "node.sh").write_text(jobscript.node_script(
        job_dir=str(tmp_path), workdir=str(tmp_path / "w"), rank_var="RANK", has_setup=False,
        has_run=True))
    home = tmp_path / "home"  # the job user's home: no ~/.bashrc unless a test writes one
    home.mkdir(exist_ok=True)
    return subprocess.run(["/bin/bash", str(tmp_path / "node.sh"), "run"], capture_output=True,
                          text=True, env={"RANK": "1", "PATH": path or "/usr/bin:/bin",
                                          "HOME": str(home)}, timeout=30)


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


# A Debian user's ~/.bashrc: nothing after the guard is read by a non-interactive shell
_GUARDED_BASHRC = """\
case $- in
    *i*) ;;
      *) return;;
esac
alias ll='ls -l'
"""


def test_setup_and_run_see_the_users_bashrc_as_under_skypilots_bash_i(tmp_path):
    """SkyPilot runs every setup and run with ``bash -i`` after ``source ~/.bashrc``: its
    docs hand values from setup to run by appending exports to ~/.bashrc, and ``conda init``
    writes its block below Debian's interactive guard. The task's envs still win over the
    .bashrc's, as SkyPilot exports them after it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text(_GUARDED_BASHRC + "export TEST_VAR=test\n"
                                  "export V=from-bashrc\ncd /\n")
    proc = _node(tmp_path, 'echo "t=$TEST_VAR v=$V pwd=$PWD"; type -t ll; echo "done!"\n', {},
                 {"V": "from-envs"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"t=test v=from-envs pwd={tmp_path / 'w'}\nalias\ndone!\n"
    assert proc.stderr == ""  # no job-control notes, no history expansion of "done!"
    assert not (home / ".bash_history").exists()


def test_conda_activate_works_as_conda_sh_is_sourced(tmp_path):
    """59 of SkyPilot's 345 example YAMLs call ``conda activate``: a shell function that
    conda's ``etc/profile.d/conda.sh`` defines, sourced by SkyPilot's prologue."""
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "etc/profile.d").mkdir(parents=True)
    (conda / "bin/conda").write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'info --base' ] && "
                                     f"echo {conda}\n")
    (conda / "bin/conda").chmod(0o755)
    (conda / "etc/profile.d/conda.sh").write_text(
        'conda() { [ "$1" = activate ] && export CONDA_DEFAULT_ENV="$2"; }\n')
    proc = _node(tmp_path, 'conda activate myenv && echo "env=$CONDA_DEFAULT_ENV"\n', {},
                 path=f"{conda / 'bin'}:/usr/bin:/bin")
    assert (proc.returncode, proc.stdout) == (0, "env=myenv\n"), proc.stderr


def _image_without_sudo(tmp_path, uid: int, tools: tuple[str, ...]) -> str:
    """A PATH of ``tools`` and no sudo (a slim image), whose ``id -u`` says ``uid``: the
    prologue's choice is shown for root and for another user, whoever runs the tests."""
    import shutil

    bare = tmp_path / "bin"
    bare.mkdir()
    for tool in tools:
        (bare / tool).symlink_to(shutil.which(tool))
    (bare / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bare / "id").chmod(0o755)
    return str(bare)


@pytest.mark.parametrize("uid", [0, 1000])
def test_python_output_is_unbuffered_and_sudo_works_for_root(tmp_path, uid):
    """Python's output reaches the log as it is printed (SkyPilot exports PYTHONUNBUFFERED:
    a job killed mid-run keeps the lines before); ``sudo`` where root has none (a slim
    image) runs the command without its options, as in SkyPilot's images."""
    path = _image_without_sudo(tmp_path, uid, ("bash", "mkdir", "true"))
    proc = _node(tmp_path, 'echo "unbuffered=$PYTHONUNBUFFERED"\n'
                           'sudo -E -u root true && echo "sudo ok"; bash -c "sudo true" && '
                           'echo "sudo in a child ok"\n', {}, path=path)
    assert proc.stdout.startswith("unbuffered=1\n"), proc.stderr
    if uid == 0:
        assert proc.stdout == "unbuffered=1\nsudo ok\nsudo in a child ok\n", proc.stderr
    else:  # not root: no sudo is made up
        assert "sudo ok" not in proc.stdout


@pytest.mark.parametrize("slow_bashrc", [False, True])
def test_a_term_stops_the_interactive_script_before_its_next_command(tmp_path, slow_bashrc):
    """An interactive bash ignores SIGTERM: scancel's TERM (or a time limit's) ended the
    running command and the script went on to the next one until KillWait's SIGKILL. A TERM
    while a slow ~/.bashrc is read (``pyenv init`` waiting for its rehash lock) reached the
    trap's ``exit``, which the prologue shadows there: the job went on to run."""
    import signal
    import time

    (tmp_path / "env.sh").write_text("")
    (tmp_path / "run.sh").write_text(jobscript.user_script(
        f"sleep {1 if slow_bashrc else 30}\ntouch {tmp_path / 'went-on'}\n"))
    (tmp_path / "node.sh").write_text(jobscript.node_script(
        job_dir=str(tmp_path), workdir=str(tmp_path / "w"), rank_var="RANK", has_setup=False,
        has_run=True))
    (tmp_path / "home").mkdir()
    if slow_bashrc:
        (tmp_path / "home" / ".bashrc").write_text("sleep 3\n")
    proc = subprocess.Popen(["bash", str(tmp_path / "node.sh"), "run"], start_new_session=True,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")})
    time.sleep(1.5)
    os_kill = __import__("os").killpg
    os_kill(proc.pid, signal.SIGTERM)  # as Slurm signals every process of the step
    assert proc.wait(timeout=20) == 143
    time.sleep(0.5)
    assert not (tmp_path / "went-on").exists()


def test_a_bashrc_that_execs_another_shell_or_exits_does_not_end_the_job(tmp_path):
    """``[[ $- == *i* ]] && exec zsh`` (a login shell switch where chsh is not allowed) or an
    ``exit`` in ~/.bashrc ended the interactive script at once, exit 0: a job that never ran
    its code read as succeeded. And RHEL's root .bashrc aliases rm, cp and mv to their ``-i``
    forms, whose prompt reads no answer and does nothing."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text(_GUARDED_BASHRC + "alias rm='rm -i' cp='cp -i' mv='mv -i'\n"
                                  "[[ $- == *i* ]] && exec sh\nexit 0\n")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "old").write_text("x")
    proc = _node(tmp_path, "rm old && echo reached; exit 7\n", {})
    assert (proc.returncode, proc.stdout) == (7, "airflow-skypilot: ~/.bashrc: exec sh skipped\n"
                                              "airflow-skypilot: ~/.bashrc: exit 0 skipped\n"
                                              "reached\n"), proc.stderr  # one stream
    assert not (tmp_path / "w" / "old").exists()


def test_the_sudo_stand_in_takes_options_and_assignments(tmp_path):
    path = _image_without_sudo(tmp_path, 0, ("bash", "mkdir", "env", "printenv"))
    proc = _node(tmp_path, "sudo DEBIAN_FRONTEND=noninteractive printenv DEBIAN_FRONTEND\n"
                           "sudo -u; echo after-a-lone-u\n", {}, path=path)
    assert proc.stdout == "noninteractive\nafter-a-lone-u\n", proc.stderr


def test_a_missing_script_says_so(tmp_path):
    proc = _node(tmp_path, "true\n", {})
    (tmp_path / "run.sh").unlink()
    proc = subprocess.run(["/bin/bash", str(tmp_path / "node.sh"), "run"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                          timeout=30)
    assert proc.returncode == 127 and "run.sh cannot be read" in proc.stderr


def test_setup_runs_without_the_gpu_assignment_run_keeps_it(tmp_path):
    """SkyPilot runs ``unset CUDA_VISIBLE_DEVICES; <setup>`` (its examples/env_check.yaml
    fails its setup when the variable is set); Slurm sets it in the job's GPU step, where the
    setup runs. The run sees it as Slurm set it. Even a ~/.bashrc's export goes in setup."""
    for name, body in (("setup.sh", 'echo "setup: ${CUDA_VISIBLE_DEVICES-unset}"\n'),
                       ("run.sh", 'echo "run: ${CUDA_VISIBLE_DEVICES-unset}"\n')):
        (tmp_path / name).write_text(jobscript.user_script(body))
    (tmp_path / "env.sh").write_text(jobscript.exports({}))
    (tmp_path / "node.sh").write_text(jobscript.node_script(
        job_dir=str(tmp_path), workdir=str(tmp_path / "w"), rank_var="RANK", has_setup=True,
        has_run=True))
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export CUDA_VISIBLE_DEVICES=0,1\n")
    out = [subprocess.run(["/bin/bash", str(tmp_path / "node.sh"), step], capture_output=True,
                          text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(home),
                               "CUDA_VISIBLE_DEVICES": "0,1"}).stdout
           for step in ("setup", "run")]
    assert out == ["setup: unset\n", "run: 0,1\n"]


@pytest.mark.parametrize("secrets", [{}, {"TOKEN": "s3cr3t"}])
def test_stdout_and_stderr_are_one_stream_in_the_order_written(tmp_path, secrets):
    """SkyPilot runs setup and run with ``stderr=subprocess.STDOUT``: a ``set -x`` trace and
    the output it traces interleave as written. A pod's stdout and stderr are read apart (the
    kubelet, containerd), so two streams came out of order there; with secrets they were
    already one (the masking pipe)."""
    proc = _node(tmp_path, "set -x\necho one\necho two >&2\necho three\n", secrets)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "+ echo one\none\n+ echo two\ntwo\n+ echo three\nthree\n"
    assert proc.stderr == ""


def test_masked_output_comes_as_it_is_written_not_at_the_end(tmp_path):
    """With a secret the output goes through the mask's awk; Debian's awk (mawk) read its pipe
    in 4 KiB blocks whatever fflush() did, so a job with HF_TOKEN set showed no line until it
    ended. The first line must come while the script still sleeps."""
    import time

    _node(tmp_path, "echo first; sleep 4; echo second\n", {"TOKEN": "s3cr3t-value"})  # files
    home = tmp_path / "home"
    start = time.monotonic()
    with subprocess.Popen(["/bin/bash", str(tmp_path / "node.sh"), "run"], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          env={"RANK": "0", "PATH": "/usr/bin:/bin", "HOME": str(home),
                               "TOKEN": "s3cr3t-value"}) as proc:
        first = proc.stdout.readline()
        took = time.monotonic() - start
        rest = proc.stdout.read()
    assert (first, rest, proc.returncode) == ("first\n", "second\n", 0)
    assert took < 3.5, f"the first line came after {took:.1f}s, with the job's end"


def test_a_secret_across_4_kib_of_a_long_line_is_masked(tmp_path):
    """The mask reads lines as they come (mawk -W interactive): a secret straddling byte 4096
    of a longer line must still be masked, in one line (mawk 1.3.3's -W interactive cut lines
    there, so it is not used with that mawk)."""
    proc = _node(tmp_path, 'printf "%04080d%s tail\\n" 0 "$TOKEN"\n', {"TOKEN": "s3cr3t-value"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0" * 4080 + "*** tail\n"
