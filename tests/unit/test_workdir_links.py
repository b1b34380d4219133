"""Symbolic links in a workdir or file-mount folder travel as links, as SkyPilot's ``rsync -a``
sends them (``-l``): the same target text, relative or absolute, inside the tree or not,
dangling or not; never followed. The ignore rules name a link as rsync does, as a
non-directory (``x/`` does not name a link to a folder). Checked against the real rsync, for
:func:`walk`, for Slurm's upload applied to a local folder, and for the Kubernetes and AWS
archives. A workdir or file mount *given* as a link is what it points to (SkyPilot resolves a
source before its rsync); AWS's payload then did not unpack, and Kubernetes sent a file
mount as a link that dangled in the pod.

Slurm made a link to a folder an empty folder, uploaded a link to a file as a copy of it, and
failed the whole upload on a dangling link (``[Errno 2] No such file or directory``): every
partition then refused the job, and the operator waited for ever.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from typing import Any

import pytest

from airflow_skypilot.backends.common.workdir import walk
from airflow_skypilot.spec import load_task

#: a tree as ``rel -> text`` (a file) or ``rel -> "->target"`` (a link); "~out~" in a target is
#: a folder outside the tree (made by :func:`_make`)
LINKS = {
    "v3/model.bin": "weights", "v3/sub/a.txt": "a", "configs/base.yaml": "lr: 1",
    "latest": "->v3",  # to a folder
    "cfg.yaml": "->configs/base.yaml",  # to a file
    "outside": "->~out~",  # absolute, out of the tree (a folder with files)
    "gone": "->/nonexistent/airflow-skypilot/missing",  # dangling
    "nested/up": "->../v3/sub",  # relative, climbing out of its folder
    "loop": "->loop",  # to itself
}


def _make(root, files: dict[str, str], outside) -> None:
    (outside / "big.bin").parent.mkdir(parents=True, exist_ok=True)
    (outside / "big.bin").write_text("never read")
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if text.startswith("->"):
            os.symlink(text[2:].replace("~out~", str(outside)), path)
        else:
            path.write_text(text)


def _seen(root) -> dict[str, tuple[str, str]]:
    """A folder as it is: ``rel -> ("link", target) | ("file", text) | ("dir", "")``, links
    not followed."""
    out: dict[str, tuple[str, str]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir", "")
            else:
                with open(path) as fh:
                    out[rel] = ("file", fh.read())
    return out


def _rsync(src, dst) -> dict[str, tuple[str, str]]:
    """What SkyPilot's rsync (its filters: sky/utils/command_runner.py) makes of ``src``."""
    top = os.path.join(src, ".skyignore")
    args = ["--filter=dir-merge,- .skyignore"] if os.path.isfile(top) else \
        ["--filter=dir-merge,- .gitignore"]
    subprocess.run(["rsync", "-a", *args, f"{src}/", f"{dst}/"], check=True)
    return _seen(dst)


def _walked(src) -> dict[str, tuple[str, str]]:
    """What walk() says travels, in the same terms."""
    out: dict[str, tuple[str, str]] = {}
    for entry in walk(str(src)):
        path, rel, is_dir = entry
        target = getattr(entry, "target", None)
        if target is not None:
            out[rel] = ("link", target)
        elif is_dir:
            out[rel] = ("dir", "")
        else:  # read as an upload reads it (a dangling link listed as a file cannot be)
            try:
                with open(path) as fh:
                    out[rel] = ("file", fh.read())
            except OSError as exc:
                out[rel] = ("unreadable", exc.strerror or "")
    return out


# --- walk() -------------------------------------------------------------------------------------


def test_walk_reports_each_link_with_its_target_and_never_follows_it(tmp_path):
    src = tmp_path / "src"
    _make(src, LINKS, tmp_path / "out")
    got = _walked(src)
    for rel in ("latest", "cfg.yaml", "outside", "gone", "nested/up", "loop"):
        assert got[rel] == ("link", os.readlink(src / rel)), (rel, got.get(rel))
    assert not [rel for _, rel, is_dir in walk(str(src)) if is_dir and os.path.islink(src / rel)]
    # nothing under a link to a folder: it is not entered
    assert not [rel for rel in got if rel.startswith(("latest/", "outside/", "nested/up/"))]
    assert got == _rsync(src, tmp_path / "dst")


@pytest.mark.parametrize("ignore", [
    "latest/\ncfg.yaml/\n",  # dir-only patterns: a link (to a folder or not) is no folder
    "latest\ngone\n",  # by name, as a file
    "/outside\n*.yaml\nnested/*\n",  # anchored, wildcards, a path's end
    "v3/\n",  # the real folder stays behind, the link to it travels (dangling then)
    "sub/\n",  # v3/sub stays behind; nested/up (a link to it) travels
])
def test_links_are_left_out_as_rsync_leaves_them_out(tmp_path, ignore):
    src = tmp_path / "src"
    _make(src, {**LINKS, ".gitignore": ignore}, tmp_path / "out")
    assert _walked(src) == _rsync(src, tmp_path / "dst")


def test_a_skyignore_names_links_too(tmp_path):
    src = tmp_path / "src"
    _make(src, {**LINKS, ".skyignore": "latest/\ngone\n", "v3/.skyignore": "sub/\n"},
          tmp_path / "out")
    got = _walked(src)
    assert got == _rsync(src, tmp_path / "dst")
    assert got["latest"] == ("link", "v3") and "gone" not in got


# --- Slurm: the upload plan, applied over a local "SFTP" ----------------------------------------


class _File:
    def __init__(self, fh):
        self.fh = fh

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()

    def set_pipelined(self, _: bool) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.fh.write(data)


class LocalSFTP:
    """paramiko's SFTPClient calls the upload makes, on the local file system (the same
    errors: OSError)."""

    def __init__(self):
        self.calls: list[str] = []

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and name != "calls":
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def stat(self, path):
        return os.stat(path)

    def lstat(self, path):
        return os.lstat(path)

    def mkdir(self, path, mode):
        os.mkdir(path, mode)

    def chmod(self, path, mode):
        os.chmod(path, mode)

    def remove(self, path):
        os.remove(path)

    def symlink(self, source, dest):  # paramiko's names: the link at dest, to source
        os.symlink(source, dest)

    def open(self, path, mode):
        return _File(open(path, mode + "b"))

    def posix_rename(self, old, new):
        os.replace(old, new)


def _upload(task, job_dir: str, home: str) -> LocalSFTP:
    from airflow_skypilot.backends.slurm import submit
    from airflow_skypilot.backends.slurm.remote import _apply

    sftp = LocalSFTP()
    for step in submit.upload_plan(task, job_dir, {"run.sh": ("x", 0o600)}, home):
        _apply(sftp, step)
    return sftp


def test_slurms_upload_makes_the_links_rsync_makes(tmp_path):
    """The workdir and a file-mount folder with links to a folder, to a file, out of the
    tree, and dangling: on the cluster each is the same link (not an empty folder, not a copy),
    the files are there, and the upload does not fail; applied twice (a retried upload into the
    same job dir) it is the same."""
    src = tmp_path / "src"
    _make(src, {**LINKS, ".gitignore": "sub/\n"}, tmp_path / "out")
    want = _rsync(src, tmp_path / "dst")
    job, home = tmp_path / "remote" / "job", tmp_path / "remote" / "home"
    task = load_task({"run": "x", "workdir": str(src), "file_mounts": {"~/m": str(src)}})
    home.mkdir(parents=True)
    sftp = _upload(task, str(job), str(home))
    assert _seen(job / "workdir") == want and _seen(home / "m") == want
    # one request per link, none more: a tree's folder is looked at with lstat, not stat
    assert sftp.calls.count("symlink") == 12 and "remove" not in sftp.calls  # 6 links, twice
    assert (job / "workdir" / "latest" / "model.bin").read_text() == "weights"
    _upload(task, str(job), str(home))
    assert _seen(job / "workdir") == want and _seen(home / "m") == want


def test_a_link_does_not_replace_a_folder(tmp_path):
    from airflow_skypilot.backends.slurm.remote import MakeLink, _apply

    (tmp_path / "d").mkdir()
    with pytest.raises(OSError):
        _apply(LocalSFTP(), MakeLink("v3", str(tmp_path / "d")))
    assert (tmp_path / "d").is_dir() and not (tmp_path / "d").is_symlink()


# --- Kubernetes and AWS: their tars keep the links ----------------------------------------------


def _members(tar_bytes: bytes) -> dict[str, tuple[str, str]]:
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        for m in tar.getmembers():
            name = m.name[2:] if m.name.startswith("./") else m.name
            if m.issym():
                out[name] = ("link", m.linkname)
            elif m.isdir():
                out[name] = ("dir", "")
            else:
                out[name] = ("file", tar.extractfile(m).read().decode())
    return out


def test_kubernetes_bundle_keeps_links_as_rsync_does(tmp_path):
    import base64

    from airflow_skypilot.backends.kubernetes import bundle

    src = tmp_path / "src"
    _make(src, LINKS, tmp_path / "out")
    packed = bundle.bundle(load_task({"run": "x", "workdir": str(src)}))
    got = _members(base64.b64decode(packed.data["workdir.tgz.b64"]))
    assert got == _rsync(src, tmp_path / "dst")


def test_aws_payload_keeps_links_as_rsync_does(tmp_path):
    from airflow_skypilot.backends.aws import userdata

    src = tmp_path / "src"
    _make(src, LINKS, tmp_path / "out")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        userdata._add_tree(tar, str(src), "workdir")
    got = {rel[len("workdir/"):]: what for rel, what in _members(buf.getvalue()).items()
           if rel.startswith("workdir/")}
    assert got == _rsync(src, tmp_path / "dst")


# --- a source given as a link: SkyPilot resolves it (Path.resolve()) before its rsync ----------


def _linked_sources(tmp_path):
    """A workdir and file mounts given as links (symlink_playground.yaml's ``workdir:
    ~/Downloads/temp1``): a link to a folder with a link inside, a relative link to a file."""
    real = tmp_path / "real"
    _make(real, {"v3/model.bin": "weights", "latest": "->v3"}, tmp_path / "out")
    (tmp_path / "base.yaml").write_text("lr: 1")
    (tmp_path / "wd").symlink_to(real)
    (tmp_path / "cfg.yaml").symlink_to("base.yaml")
    return load_task({"run": "x", "workdir": str(tmp_path / "wd"), "file_mounts": {
        "mnt": str(tmp_path / "wd"), "cfg.yaml": str(tmp_path / "cfg.yaml")}})


_RESOLVED = {"v3": ("dir", ""), "v3/model.bin": ("file", "weights"), "latest": ("link", "v3")}


def test_aws_payload_unpacks_a_workdir_given_as_a_link(tmp_path):
    """The payload held ``workdir`` as a link and its files under it: tar on the node could
    not unpack it ("Cannot mkdir: Not a directory"), and the node's bootstrap failed."""
    import gzip

    from airflow_skypilot.backends.aws import userdata

    payload = userdata.render_payload(_linked_sources(tmp_path), {})
    node = tmp_path / "node"
    node.mkdir()
    (tmp_path / "payload.tar").write_bytes(gzip.decompress(payload.data))
    subprocess.run(["tar", "-xf", str(tmp_path / "payload.tar"), "-C", str(node)], check=True)
    assert _seen(node / "workdir") == _RESOLVED
    # sorted by destination: 0 is cfg.yaml, 1 is mnt
    assert (node / "mounts" / "0").read_text() == "lr: 1"
    assert not (node / "mounts" / "0").is_symlink()
    assert _seen(node / "mounts" / "1") == _RESOLVED


def test_kubernetes_bundle_sends_the_file_a_mount_link_points_to(tmp_path):
    import base64

    from airflow_skypilot.backends.kubernetes import bundle

    packed = bundle.bundle(_linked_sources(tmp_path))
    got = {key: _members(base64.b64decode(text)) for key, text in packed.data.items()}
    assert got["workdir.tgz.b64"] == _RESOLVED
    assert {"cfg.yaml": ("file", "lr: 1")} in got.values()
    assert [k for k, v in got.items() if v == _RESOLVED and k != "workdir.tgz.b64"]


def test_slurm_upload_sends_what_a_source_link_points_to(tmp_path):
    task = _linked_sources(tmp_path)
    job, home = tmp_path / "remote" / "job", tmp_path / "remote" / "home"
    home.mkdir(parents=True)
    _upload(task, str(job), str(home))
    wd = _seen(job / "workdir")
    assert {k: v for k, v in wd.items() if not k.startswith("mnt/")} == \
        {**_RESOLVED, "mnt": ("dir", ""), "cfg.yaml": ("file", "lr: 1")}
    assert _seen(job / "workdir" / "mnt") == _RESOLVED


def _tree_of(root, files: dict[str, str]) -> str:
    """A local tree: ``rel -> text`` files, ``rel -> "->target"`` links."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if text.startswith("->"):
            os.symlink(text[2:], path)
        else:
            path.write_text(text)
    return str(root)


def test_a_mount_over_a_workdir_link_replaces_the_link_not_its_target(tmp_path):
    """The workdir has cfg.yaml -> configs/dev.yaml and a file mount puts prod.yaml at
    cfg.yaml: rsync writes aside and renames over the link; writing through it turned
    configs/dev.yaml into prod (a review)."""
    src = _tree_of(tmp_path / "src", {"configs/dev.yaml": "dev", "cfg.yaml": "->configs/dev.yaml"})
    (tmp_path / "prod.yaml").write_text("prod")
    task = load_task({"run": "x", "workdir": src,
                      "file_mounts": {"cfg.yaml": str(tmp_path / "prod.yaml")}})
    sky = tmp_path / "sky"
    subprocess.run(["rsync", "-a", f"{src}/", f"{sky}/"], check=True)
    subprocess.run(["rsync", "-a", str(tmp_path / "prod.yaml"), f"{sky}/cfg.yaml"], check=True)
    job, home = tmp_path / "remote/job", tmp_path / "remote/home"
    home.mkdir(parents=True)
    _upload(task, str(job), str(home))
    assert _seen(job / "workdir") == _seen(sky)
    assert (job / "workdir/configs/dev.yaml").read_text() == "dev"


def test_an_aws_mount_over_a_workdir_link_replaces_the_link_not_its_target(tmp_path):
    """The same on an AWS node: the payload unpacked as the bootstrap unpacks it, then its
    mounts.sh (a file mount at cfg.yaml, a folder mount over a folder of links): ``cp -a``
    wrote through each link (configs/dev.yaml became prod, and so did what conf/x pointed
    to); rsync, and now cp --remove-destination, replace the link."""
    import gzip

    from airflow_skypilot.backends.aws import userdata

    src = _tree_of(tmp_path / "src", {"configs/dev.yaml": "dev", "cfg.yaml": "->configs/dev.yaml",
                                      "conf/x": "->../configs/dev.yaml"})
    (tmp_path / "prod.yaml").write_text("prod")
    _tree_of(tmp_path / "conf", {"x": "new x"})
    task = load_task({"run": "x", "workdir": src, "file_mounts": {
        "cfg.yaml": str(tmp_path / "prod.yaml"), "conf": str(tmp_path / "conf")}})
    sky = tmp_path / "sky"
    subprocess.run(["rsync", "-a", f"{src}/", f"{sky}/"], check=True)
    subprocess.run(["rsync", "-a", str(tmp_path / "prod.yaml"), f"{sky}/cfg.yaml"], check=True)
    subprocess.run(["rsync", "-a", f"{tmp_path / 'conf'}/", f"{sky}/conf/"], check=True)
    job = tmp_path / "node" / "job"
    job.mkdir(parents=True)
    (tmp_path / "payload.tar").write_bytes(gzip.decompress(userdata.render_payload(task, {}).data))
    subprocess.run(["tar", "-xf", str(tmp_path / "payload.tar"), "-C", str(job)], check=True)
    done = subprocess.run(["bash", str(job / "mounts.sh")], capture_output=True, text=True,
                          env={"JOB_DIR": str(job), "HOME": str(tmp_path / "node"),
                               "PATH": "/usr/bin:/bin"}, timeout=30)
    assert done.returncode == 0, done.stderr
    assert _seen(job / "workdir") == _seen(sky)
    assert (job / "workdir/configs/dev.yaml").read_text() == "dev"


def test_what_an_earlier_job_left_as_a_link_is_replaced_never_written_through(tmp_path):
    """Job A mounts ~/m with links (to a file of its own, to a file outside every job dir,
    to a file where job B has a folder); job B's ~/m has plain files and that folder: as
    rsync, each link is replaced; nothing outside is written or chmodded, and the upload
    does not fail on the folder (it failed every partition before)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o600)
    a = _tree_of(tmp_path / "a", {"v1/model.bin": "weights-v1", "latest": "->v1/model.bin",
                                  "out": f"->{victim}", "f": "f", "x": "->f"})
    b = _tree_of(tmp_path / "b", {"latest": "a note", "out": "overwritten", "x/data": "d"})
    (tmp_path / "b" / "out").chmod(0o755)
    home = tmp_path / "remote/home"
    home.mkdir(parents=True)
    for name, src in (("j1", a), ("j2", b)):
        _upload(load_task({"run": "x", "file_mounts": {"~/m": src}}), str(tmp_path / name),
                str(home))
    assert (home / "m/v1/model.bin").read_text() == "weights-v1"
    assert (victim.read_text(), victim.stat().st_mode & 0o777) == ("precious", 0o600)
    assert (home / "m/latest").read_text() == "a note" and not (home / "m/latest").is_symlink()
    assert (home / "m/x/data").read_text() == "d" and not (home / "m/x").is_symlink()


def test_an_upload_aside_has_a_name_of_its_own_and_goes_when_it_fails(tmp_path):
    """Written aside then renamed (the previous test): two jobs mounting one file at once do
    not share the aside name (the second's rename found it gone, a refused submission), a
    name of 240 bytes still fits (255 with the suffix did not), and a failed write leaves
    nothing (a read-only leftover blocked every later upload of that file)."""
    from airflow_skypilot.backends.slurm.remote import PutFile, _apply

    home = tmp_path / "home"
    home.mkdir()
    src = tmp_path / ("n" * 240)
    src.write_text("{}")
    src.chmod(0o444)
    step = PutFile(str(src), str(home / src.name))

    class Racing(LocalSFTP):
        def open(self, path, mode):
            fh = LocalSFTP.open(self, path, mode)
            _apply(LocalSFTP(), step)  # the other job's whole upload of the same file
            return fh

    _apply(Racing(), step)
    assert sorted(os.listdir(home)) == [src.name] and (home / src.name).read_text() == "{}"

    class Failing(LocalSFTP):
        def posix_rename(self, old, new):
            raise OSError(5, "the connection broke")

    with pytest.raises(OSError):
        _apply(Failing(), PutFile(str(src), str(home / "other")))
    assert sorted(os.listdir(home)) == [src.name]


def test_a_server_without_posix_rename_gets_a_plain_rename(tmp_path):
    """paramiko raises a bare IOError("Operation unsupported") (no errno) where a server lacks
    OpenSSH's posix-rename: the upload still replaces what is there, link or file."""
    from airflow_skypilot.backends.slurm.remote import PutFile, _apply

    (tmp_path / "new").write_text("new")
    os.symlink("elsewhere", tmp_path / "there")

    class Plain(LocalSFTP):
        def posix_rename(self, old, new):
            raise OSError("Operation unsupported")

        def rename(self, old, new):  # SFTP's rename refuses an existing target
            if os.path.lexists(new):
                raise OSError(17, "exists")
            os.rename(old, new)

    _apply(Plain(), PutFile(str(tmp_path / "new"), str(tmp_path / "there")))
    assert (tmp_path / "there").read_text() == "new" and not (tmp_path / "there").is_symlink()


def test_a_fifo_or_socket_in_the_workdir_is_left_behind_not_read(tmp_path, caplog):
    """A FIFO in the workdir (a tool's control pipe left there): Slurm's upload opened it to
    send it and waited for a writer for ever (the worker hung before submitting); a socket
    failed it. Neither can be made over SFTP: each is left behind, with a warning naming it,
    and the rest travels."""
    import socket
    import threading

    src = _tree_of(tmp_path / "src", {"train.py": "print(1)"})
    os.mkfifo(tmp_path / "src" / "ctl.fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "src" / "s.sock"))
    try:
        assert [rel for _, rel, _ in walk(src)] == ["train.py"]
        job, home = tmp_path / "remote/job", tmp_path / "remote/home"
        home.mkdir(parents=True)
        task = load_task({"run": "x", "workdir": src})
        done = threading.Thread(target=_upload, args=(task, str(job), str(home)), daemon=True)
        done.start()
        done.join(timeout=20)
        assert not done.is_alive(), "the upload blocked on the FIFO"
        assert _seen(job / "workdir") == {"train.py": ("file", "print(1)")}
        assert "ctl.fifo is not a file, folder or link: left behind" in caplog.text
        assert "s.sock is not a file, folder or link" in caplog.text
    finally:
        sock.close()
