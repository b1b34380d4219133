"""The one rule for what a workdir ships: SkyPilot's rsync filters (.skyignore, else the
.gitignore files and .git/info/exclude, with rsync's pattern rules), ``.git`` included;
checked against the real rsync, SkyPilot's way of sending a workdir."""

from __future__ import annotations

import os
import subprocess

import pytest

from airflow_skypilot.backends.common.ignore import parse_rules
from airflow_skypilot.backends.common.workdir import walk


def _tree(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if text.startswith("->"):  # a link
            path.symlink_to(text[2:])
        else:
            path.write_text(text)


def _shipped(root, **kw) -> set[str]:
    """Files (and links: rsync -a sends a link to a folder as a link)."""
    return {rel for path, rel, is_dir in walk(str(root), **kw)
            if not is_dir or os.path.islink(path)}


def _rsync_ships(root, dst) -> set[str]:
    """What SkyPilot's own rsync command sends (sky/utils/command_runner.py's filters)."""
    top = os.path.join(root, ".skyignore")
    args = ["--filter=dir-merge,- .skyignore"] if os.path.isfile(top) else \
        ["--filter=dir-merge,- .gitignore"] + (
            [f"--exclude-from={root}/.git/info/exclude"]
            if os.path.isfile(f"{root}/.git/info/exclude") else [])
    subprocess.run(["rsync", "-a", *args, f"{root}/", f"{dst}/"], check=True)
    return {os.path.relpath(os.path.join(d, f), dst) for d, dirs, files in os.walk(dst)
            for f in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]}


#: trees with ignore files: each case's files are the same for walk() and for rsync
_CASES = {
    "gitignore basics": {".gitignore": ".venv/\n/data\n*.log\n", ".git/HEAD": "ref",
                         ".git/info/exclude": "secret.txt\n", "secret.txt": "",
                         ".venv/bin/python": "", "data/big.bin": "", "src/data/keep.py": "",
                         "run.log": "", "src/a.py": "", "src/.gitignore": "/gen\n",
                         "src/gen/out.py": "", "gen/top.py": ""},
    "skyignore wins": {".skyignore": "# data stays home\n\ndata/\n*.ckpt\n",
                       ".gitignore": "train.py\n", "train.py": "", "src/data.py": "",
                       "data/x.bin": "", "runs/last.ckpt": "", ".git/HEAD": "ref"},
    "double star": {".gitignore": "**/node_modules/\n**/__pycache__\na/**/b.txt\n"
                                  "data/**.csv\n",
                    "node_modules/x.js": "", "web/node_modules/y.js": "",
                    "__pycache__/m.pyc": "", "a/b.txt": "", "a/x/b.txt": "",
                    "data/x/y.csv": "", "keep.py": ""},
    "slashes match the end": {".gitignore": "data/*\n/top/*\nlogs/\n",
                              "src/data/a.py": "", "data/b.py": "", "src/top/c.py": "",
                              "top/d.py": "", "logs": "", "x/logs/e.txt": ""},
    "nested files see the whole path": {
        ".gitignore": "", "src/.gitignore": "src/gen\n*/*.tmp\n**/foo\n", "src/gen/a.py": "",
        "src/foo": "", "src/d/foo": "", "src/t.tmp": "", "b/t.tmp": "", "src/keep.py": ""},
    "spaces and comments": {".gitignore": "foo \n#bar\n;baz\n  qux\n!keep\n", "foo": "",
                            "#bar": "", "baz": "", "qux": "", "keep": ""},
    "triple star": {".gitignore": "out/***\n", "out/x/y": "", "z/out": "", "a.py": ""},
    "classes and escapes": {".gitignore": "ckpt[[:digit:]].pt\nx[!a]\nbad[\na\\*\n",
                            "ckpt7.pt": "", "ckptx.pt": "", "xa": "", "xb": "", "bad[": "",
                            "a*": "", "ab": ""},
    "exclude-from prefixes": {".gitignore": "", ".git/info/exclude": "- foo\n+ bar\nbar\n",
                              "foo": "", "bar": "", "baz": ""},
    "links": {".gitignore": "ldata/\n", "real/f": "", "ldata": "->real"},
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_what_travels_is_what_rsync_sends_with_skypilots_filters(tmp_path, case):
    """A git workdir's .venv, data and checkpoints travelled (on Kubernetes, past its Secret's
    size), and patterns were read as fnmatch does: the same tree through walk() and through
    the real rsync, SkyPilot's way of sending it, leaves the same files behind."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src, _CASES[case])
    assert _shipped(src) == _rsync_ships(src, dst)


@pytest.mark.parametrize("seed", range(40))
def test_random_trees_and_patterns_travel_as_rsync_sends_them(tmp_path, seed):
    """Trees and ignore files drawn at random (a fixed seed each) from names and patterns
    that exercise every rule: walk() and the real rsync leave the same files behind."""
    import random

    rnd = random.Random(seed)
    names = ["a", "b", "data", "src", "x.log", "y.py", "node_modules", "gen", "out"]
    pats = ["*.log", "/data", "data/", "data/*", "src/*", "/src/gen", "**/node_modules",
            "**/*.py", "a/**", "out/***", "?.py", "[ab]", "gen/", "src/**/y.py", "b/a",
            "*/x.log", "- a", "+ b"]
    files = {}
    for _ in range(rnd.randint(4, 14)):
        path = "/".join(rnd.choice(names) for _ in range(rnd.randint(1, 4)))
        if not any(p.startswith(path + "/") or path.startswith(p + "/") for p in files):
            files[path] = ""
    dirs = sorted({p.rpartition("/")[0] for p in files} - {""})
    for folder in ["", *rnd.sample(dirs, min(2, len(dirs)))]:
        ignore = (folder + "/" if folder else "") + ".gitignore"
        if not any(p.startswith(ignore + "/") for p in files):
            files[ignore] = "\n".join(rnd.sample(pats, rnd.randint(1, 4))) + "\n"
    if rnd.random() < 0.4:
        files[".git/info/exclude"] = "\n".join(rnd.sample(pats, 2)) + "\n"
    src, dst = tmp_path / "src", tmp_path / "dst"
    _tree(src, files)
    assert _shipped(src) == _rsync_ships(src, dst), files


def test_git_travels_but_not_when_left_out_and_everywhere_then(tmp_path, caplog, monkeypatch):
    from airflow_skypilot.backends.common import workdir

    _tree(tmp_path, {".git/HEAD": "ref", ".git/objects/a": "", "vendor/x/.git/HEAD": "ref",
                     "a.py": ""})
    assert _shipped(tmp_path) == {".git/HEAD", ".git/objects/a", "vendor/x/.git/HEAD", "a.py"}
    assert _shipped(tmp_path, keep_git=False) == {"a.py"}
    assert ".git travels" not in caplog.text
    monkeypatch.setattr(workdir, "GIT_FILES_NOTED", 1)  # a long history: a note of the cost
    _shipped(tmp_path)
    assert ".git travels with it, as in SkyPilot (2 files)" in caplog.text


@pytest.mark.parametrize("pattern, path, is_dir, excluded", [
    ("data/*", "src/data/a.py", False, True),  # rsync: the end of the path (SkyPilot #3298)
    ("/data/*", "src/data/a.py", False, False),
    ("**/node_modules/", "node_modules", True, True),  # a leading **/ may be no folder
    ("logs/", "logs", False, False),  # a file named like a dir-only pattern
    ("out/***", "out", False, False),  # the folder, not a file
    ("!keep.log", "keep.log", False, False),
])
def test_rsyncs_pattern_rules(pattern, path, is_dir, excluded):
    rules = parse_rules(pattern)
    assert any(rule.matches(path, is_dir) for rule in rules) is excluded


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
    assert mount_destination("~/a/b/") == ("home", "a/b/")
    assert mount_destination("/a/b") == ("root", "/a/b")
    assert mount_destination("rel") == ("workdir", "rel")
    assert mount_destination("./a/b/") == ("workdir", "a/b/")
    assert mount_destination(".") == mount_destination("") == ("workdir", "")
    assert mount_destination("../x") == mount_destination("./../x") == ("home", "x")
    assert mount_destination("..") == ("home", "")
    assert mount_destination("../../x") == ("home", "../x")


def test_a_secret_in_a_destination_is_never_normalised_out_of_sight():
    """The destination was normalised before the secret in it was looked for: a value with
    ``//`` or a trailing ``/`` was no longer found, and went into the script in clear."""
    from airflow_skypilot.backends.kubernetes.bundle import _dest_dir_word

    for dst, value in (("~/team//abc/data", "team//abc"), ("~/https://h/x/d", "https://h/x"),
                       ("./in/tok/", "tok/")):
        word = _dest_dir_word(dst, {"S": value})
        assert value not in word and '"${S}"' in word, word


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
