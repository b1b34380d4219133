"""The one rule for what a workdir ships: SkyPilot's rsync filters (.skyignore, else the
.gitignore files and .git/info/exclude, with rsync's pattern rules), ``.git`` included."""

from __future__ import annotations

import pytest

from airflow_skypilot.backends.common.workdir import parse_rules, walk


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _shipped(root, **kw) -> set[str]:
    return {rel for _, rel, is_dir in walk(str(root), **kw) if not is_dir}


def test_skyignore_lines_and_nothing_else(tmp_path):
    """With a .skyignore, only the .skyignore files count (SkyPilot: not .gitignore)."""
    _tree(tmp_path, {".skyignore": "# data stays home\n\ndata/\n*.ckpt\n",
                     ".gitignore": "train.py\n", "train.py": "", "src/data.py": "",
                     "data/x.bin": "", "runs/last.ckpt": "", ".git/HEAD": "ref"})
    assert _shipped(tmp_path) == {".skyignore", ".gitignore", "train.py", "src/data.py",
                                  ".git/HEAD"}


def test_without_skyignore_the_gitignore_files_and_git_info_exclude_count(tmp_path):
    """A git workdir's .venv, data and checkpoints travelled (on Kubernetes, past its Secret's
    size): SkyPilot leaves out what .gitignore lists, in every folder, and
    .git/info/exclude; .git itself travels (``git`` works in the job)."""
    _tree(tmp_path, {".gitignore": ".venv/\n/data\n*.log\n", ".git/HEAD": "ref",
                     ".git/info/exclude": "secret.txt\n", "secret.txt": "",
                     ".venv/bin/python": "", "data/big.bin": "", "src/data/keep.py": "",
                     "run.log": "", "src/a.py": "", "src/.gitignore": "/gen\n",
                     "src/gen/out.py": "", "gen/top.py": ""})
    assert _shipped(tmp_path) == {".gitignore", ".git/HEAD", ".git/info/exclude",
                                  "src/data/keep.py", "src/a.py", "src/.gitignore",
                                  "gen/top.py"}
    assert ".git/HEAD" not in _shipped(tmp_path, keep_git=False)


@pytest.mark.parametrize("pattern, path, is_dir, excluded", [
    ("data/*", "data/a.py", False, True),
    ("data/*", "src/data/a.py", False, True),  # rsync: the end of the path (SkyPilot #3298)
    ("/data/*", "src/data/a.py", False, False),
    ("data/*.csv", "data/x/y.csv", False, False),  # * does not cross /
    ("data/**.csv", "data/x/y.csv", False, True),
    ("*.log", "a/b/c.log", False, True),  # no slash: the last component, at any depth
    ("logs/", "logs", False, False),  # a file named like a dir-only pattern
    ("logs/", "a/logs", True, True),
    ("out/***", "out", True, True),
    ("out/***", "out/x/y", False, True),
    ("ch?p[0-9].pt", "chkp7.pt", False, True),
    ("x[!a]", "xa", False, False),
    ("!keep.log", "keep.log", False, False),  # git's negation: rsync reads a name
])
def test_rsyncs_pattern_rules(pattern, path, is_dir, excluded):
    (rule,) = parse_rules(pattern) or (None,)
    got = rule is not None and rule.matches(path, is_dir)
    assert got is excluded


def test_a_nested_ignore_files_patterns_start_at_its_folder(tmp_path):
    _tree(tmp_path, {".skyignore": "", "a/.skyignore": "/x\nb/*.tmp\n", "a/x": "",
                     "x": "", "a/b/t.tmp": "", "b/t.tmp": ""})
    assert _shipped(tmp_path) == {".skyignore", "a/.skyignore", "x", "b/t.tmp"}


# --- where a relative file mount lands: under the job's workdir, as SkyPilot's ~/sky_workdir --


def _mount_sources(tmp_path):
    data = tmp_path / "data"
    (data / "deep").mkdir(parents=True, exist_ok=True)
    (data / "deep" / "f.txt").write_text("from a dir mount\n")
    (tmp_path / "one.cfg").write_text("from a file mount\n")
    return str(data), str(tmp_path / "one.cfg")


def _relative_mounts(tmp_path, **fields):
    from airflow_skypilot.spec import load_task

    data, one = _mount_sources(tmp_path)
    return load_task({"run": "x", **fields, "file_mounts": {
        "relative_dir": data, "./dot/one.cfg": one, "top.cfg": one,
        "~/home.cfg": one, "/abs/a.cfg": one, "../up.cfg": one}})


def test_a_file_mount_destination_lands_where_skypilots_would():
    """One rule for every backend: SkyPilot joins a relative destination to ~/sky_workdir,
    so ``../x`` is ~/x there (it landed in the job's own dir here)."""
    from airflow_skypilot.backends.common.workdir import mount_destination

    assert mount_destination("~") == mount_destination("~/") == ("home", "")
    assert mount_destination("~/a/b/") == ("home", "a/b")
    assert mount_destination("/a/b") == ("root", "/a/b")
    assert mount_destination("rel") == ("workdir", "rel")
    assert mount_destination("./a/b/") == ("workdir", "a/b")
    assert mount_destination(".") == mount_destination("") == ("workdir", "")
    assert mount_destination("../x") == mount_destination("a/../../x") == ("home", "x")
    assert mount_destination("..") == ("home", "")


def test_slurm_puts_a_relative_file_mount_under_the_jobs_workdir(tmp_path):
    """It went to the login node's $HOME (a relative SFTP path), not the job's cwd."""
    from airflow_skypilot.backends.slurm import submit
    from airflow_skypilot.backends.slurm.remote import MakeDirs, PutFile

    job_dir = "/home/u/.airflow-skypilot/jobs/sky-x"
    wd = f"{job_dir}/workdir"
    for fields in ({}, {"workdir": str(tmp_path / "data")}):  # with a workdir or none
        plan = submit.upload_plan(_relative_mounts(tmp_path, **fields), job_dir, {}, "/home/u")
        puts = [s.remote for s in plan if isinstance(s, PutFile)]
        assert {f"{wd}/relative_dir/deep/f.txt", f"{wd}/dot/one.cfg", f"{wd}/top.cfg",
                "/home/u/home.cfg", "/abs/a.cfg", "/home/u/up.cfg"} <= set(puts), puts
        assert not [p for p in puts if not p.startswith("/")]  # nothing left to SFTP's cwd
        # the workdir is made, and filled, before any mount goes into it
        assert plan.index(MakeDirs(wd, 0o700)) < plan.index(MakeDirs(f"{wd}/relative_dir",
                                                                     0o755))
        if fields:
            assert puts.index(f"{wd}/deep/f.txt") < puts.index(f"{wd}/relative_dir/deep/f.txt")
    assert submit.mount_target("relative_dir", "/home/u", wd) == f"{wd}/relative_dir"
    assert submit.mount_target("./a/b/", "/home/u", wd) == f"{wd}/a/b"
    assert submit.mount_target("~/a", "/home/u", wd) == "/home/u/a"
    assert submit.mount_target("~", "/home/u", wd) == "/home/u"
    assert submit.mount_target("/a/b", "/home/u", wd) == "/a/b"
    assert submit.mount_target("../b", "/home/u", wd) == "/home/u/b"


def test_kubernetes_unpacks_a_relative_file_mount_under_the_jobs_workdir(tmp_path):
    """It was unpacked under "$HOME", not the pod's cwd ($AIRFLOW_SKYPILOT_WORKDIR)."""
    from airflow_skypilot.backends.kubernetes import bundle

    wd = '"$AIRFLOW_SKYPILOT_WORKDIR"'
    for fields in ({}, {"workdir": str(tmp_path / "data")}):
        got = bundle.bundle(_relative_mounts(tmp_path, **fields)).targets
        words = [word for _, word in got]
        if fields:  # the workdir first: the mounts go over it, never under it
            assert got[0] == ("workdir.tgz.b64", wd)
            words = words[1:]
        # sorted by destination: ../up.cfg, ./dot/one.cfg, /abs/a.cfg, relative_dir, top.cfg,
        # ~/home.cfg
        assert words == ['"$HOME"', f"{wd}/dot", '"$AIRFLOW_SKYPILOT_ROOT"/abs',
                         f"{wd}/relative_dir", wd, '"$HOME"']


def test_aws_copies_a_relative_file_mount_under_the_jobs_workdir(tmp_path):
    """It was copied under "$HOME", not the node's cwd ($JOB_DIR/workdir)."""
    import subprocess

    from airflow_skypilot.backends.aws.userdata import mounts_script

    script, local = mounts_script(_relative_mounts(tmp_path))
    assert '"$JOB_DIR"/workdir/relative_dir' in script and '"$HOME"/home.cfg' in script
    home, job = tmp_path / "home", tmp_path / "job"
    home.mkdir()
    (job / "mounts").mkdir(parents=True)
    for path, name in local:  # the payload as the bootstrap unpacks it
        subprocess.run(["cp", "-a", path, str(job / name)], check=True)
    kept = "\n".join(line for line in script.splitlines() if "/abs/" not in line)
    done = subprocess.run(["bash", "-c", kept], env={"HOME": str(home), "JOB_DIR": str(job),
                                                     "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert (job / "workdir" / "relative_dir" / "deep" / "f.txt").read_text() == \
        "from a dir mount\n"
    assert (job / "workdir" / "dot" / "one.cfg").exists()
    assert (job / "workdir" / "top.cfg").exists() and (home / "home.cfg").exists()
    assert not (home / "relative_dir").exists() and not (home / "top.cfg").exists()
    assert (home / "up.cfg").exists() and not (job / "up.cfg").exists()  # ~/sky_workdir/..


@pytest.mark.parametrize("there", [None, "dir of files"])
def test_aws_bootstrap_makes_sky_workdir_the_workdir_before_the_mounts(tmp_path, there):
    """The node's ~/sky_workdir (SkyPilot's workdir, where its tasks cd) is the job's
    workdir, so a mount under it lands there too; a directory of files already there is left
    as it is (a note in the log) and the job's relative mounts still are in its cwd."""
    import subprocess

    from airflow_skypilot.spec import load_task
    from tests.unit.test_aws_backend import _imds, _render, _stubs

    data, one = _mount_sources(tmp_path)
    fake, env = _stubs(tmp_path)
    _imds(fake, 0, "10.0.0.5")
    check = "test -f relative_dir/deep/f.txt && test -f ~/sky_workdir/relative_dir/deep/f.txt"
    mounts = {"relative_dir": data}
    if there:
        (tmp_path / "home" / "sky_workdir").mkdir()
        (tmp_path / "home" / "sky_workdir" / "keep.txt").write_text("mine\n")
        check = "test -f relative_dir/deep/f.txt && test -f ~/sky_workdir/keep.txt"
    else:
        mounts["~/sky_workdir/via_home/one.cfg"] = one
        check += ' && cat via_home/one.cfg && test "$(cd ~/sky_workdir; pwd -P)" = "$(pwd -P)"'
    # the files the job makes get the usual umask, not the bootstrap's 077 (SkyPilot's nodes)
    check += ' && touch made && test "$(stat -c %a made)" = 644'
    task = load_task({"file_mounts": mounts, "run": f"{check} && echo found-them"})
    script, _ = _render(task, log_interval=1)
    (tmp_path / "user-data").write_text(script)
    proc = subprocess.run(["bash", str(tmp_path / "user-data")], env=env, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = fake / "s3" / "bucket/jobs/sky-job-1/rank-0"
    log = (out / "log").read_text()
    assert (out / "exit_code").read_text() == "0\n", log
    assert "found-them" in log
    if there:
        assert "sky_workdir kept" in log
    else:
        assert "from a file mount" in log
        assert (tmp_path / "home" / "sky_workdir").is_symlink()
