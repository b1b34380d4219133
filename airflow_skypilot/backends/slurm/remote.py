"""The login node: bash scripts over SSH and file uploads over SFTP, on the ssh provider's hooks.

The worker side uses ``SSHHook`` (paramiko) and the triggerer side ``SSHHookAsync`` (asyncssh),
each with one cached connection. Scripts go on stdin to ``bash -s``, never on a command line.
Anything that means "could not ask" (no route, auth refused, timeout, connection lost) is
:class:`BackendUnreachable`; the connection is dropped so the next call connects again.

Every wait is bounded: connecting (TCP, banner, authentication: :data:`CONNECT_TIMEOUT` each),
opening a channel, and each command (its limit; a watchdog closes the connection should the
server stop answering half way, which paramiko alone would wait on for ever).

Uploads are a list of steps (:class:`MakeDirs`, :class:`Chmod`, :class:`WriteFile`,
:class:`PutFile`, :class:`MakeLink`) planned elsewhere (no remote I/O there: :mod:`uploads`)
and applied here, in order, over one SFTP channel: each SFTP request may take
``command_timeout`` and the whole upload ``upload_timeout``; past either it is a
SubmissionError (nothing was submitted yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import posixpath
import secrets
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from airflow_skypilot.exceptions import BackendError, BackendUnreachable, SubmissionError

# asyncssh logs every channel at INFO: six lines per poll in each watched task's log. Quiet it
# unless the deployment configured that logger itself.
if logging.getLogger("asyncssh").level == logging.NOTSET:
    logging.getLogger("asyncssh").setLevel(logging.WARNING)


@dataclass(frozen=True)
class MakeDirs:
    """Create ``path`` and its missing parents (each new one with ``mode``). ``in_tree``: a
    folder of an uploaded tree, where rsync replaces a link or a file already there with the
    folder (its parents, the destination, are followed as rsync follows them)."""

    path: str
    mode: int
    in_tree: bool = False


@dataclass(frozen=True)
class Chmod:
    path: str
    mode: int


@dataclass(frozen=True)
class WriteFile:
    """Write ``content`` to ``path``; its mode is set before any byte is written."""

    path: str
    content: str
    mode: int


@dataclass(frozen=True)
class PutFile:
    """Copy a local file with its permission bits, set before any byte is written (a 0600
    credential mounted from the worker is never readable by others on the login node)."""

    local: str
    remote: str


@dataclass(frozen=True)
class MakeLink:
    """Make ``path`` a symbolic link to ``target`` (its text as is: relative, absolute,
    dangling), as rsync ``-a`` sends a link; whatever non-folder is at ``path`` is replaced."""

    target: str
    path: str


UploadStep = MakeDirs | Chmod | WriteFile | PutFile | MakeLink

#: seconds for each step of connecting: the TCP connect, the server's banner, authentication
CONNECT_TIMEOUT = 15


class UploadTimeout(OSError):
    """The upload ran past its time."""


async def aload_asyncssh() -> None:
    """Import asyncssh in a thread: the ssh provider imports it inside ``get_conn()``, which
    would block the triggerer's event loop the first time."""
    await asyncio.to_thread(importlib.import_module, "asyncssh")


class SSHRunner:
    """Runs scripts on (and uploads to) the login node of one connection."""

    def __init__(self, conn_id: str, command_timeout: float, upload_timeout: float = 600.0):
        self.conn_id = conn_id
        self.command_timeout = command_timeout
        self.upload_timeout = upload_timeout
        self._hook: Any = None
        self._ahook: Any = None
        self._aconn: Any = None
        self._alock: asyncio.Lock | None = None

    # --- sync (worker) ------------------------------------------------------------------------
    def client(self) -> Any:
        """The connected paramiko client."""
        from airflow.providers.ssh.hooks.ssh import SSHHook

        if self._hook is None:
            self._hook = SSHHook(ssh_conn_id=self.conn_id, conn_timeout=CONNECT_TIMEOUT,
                                 cmd_timeout=self.command_timeout, conn_retry_attempts=1,
                                 banner_timeout=CONNECT_TIMEOUT,
                                 auth_timeout=CONNECT_TIMEOUT)
        try:
            return self._hook.get_conn()
        except Exception as exc:  # paramiko raises many kinds; all mean "cannot reach"
            raise BackendUnreachable(f"cannot reach the login node of {self.conn_id}: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        if self._hook is not None and getattr(self._hook, "client", None):
            self._hook.client.close()
            self._hook.client = None

    def _watchdog(self, seconds: float) -> threading.Timer:
        """Close the connection after ``seconds``: a server that stopped answering half way
        (paramiko waits on some replies without a limit) ends the call with an error."""
        timer = threading.Timer(seconds, self.close)
        timer.daemon = True
        timer.start()
        return timer

    def run(self, script: str, timeout: float | None = None) -> tuple[int, str, str]:
        """Run a bash script on the login node: (exit status, stdout, stderr)."""
        client = self.client()
        timeout = timeout or self.command_timeout
        watchdog = self._watchdog(timeout + CONNECT_TIMEOUT)
        try:
            transport = client.get_transport()
            chan = transport.open_session(timeout=CONNECT_TIMEOUT)
            chan.settimeout(timeout)
            chan.exec_command("bash -s")
            chan.sendall(script.encode())
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            deadline = time.monotonic() + timeout
            while True:
                if chan.recv_ready():
                    out += chan.recv(65536)
                elif chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                elif chan.exit_status_ready() and (chan.eof_received or chan.closed):
                    # sshd sends the exit status when the shell is reaped, which may be
                    # before the last output it read from the pipe: only EOF says all is in
                    # (measured on the sandbox; a lost last line read as "could not ask")
                    while chan.recv_ready():
                        out += chan.recv(65536)
                    while chan.recv_stderr_ready():
                        err += chan.recv_stderr(65536)
                    break
                else:
                    if time.monotonic() > deadline:
                        chan.close()
                        raise BackendUnreachable(
                            f"{self.conn_id}: command did not finish within {timeout:g}s")
                    if chan.closed or not transport.is_active():
                        raise BackendUnreachable(f"{self.conn_id}: connection lost")
                    time.sleep(0.01)
            rc = chan.recv_exit_status()
            chan.close()
            return rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        except (OSError, EOFError) as exc:
            self.close()
            raise BackendUnreachable(f"{self.conn_id}: connection lost: {exc}") from exc
        except Exception as exc:
            self.close()
            if isinstance(exc, BackendError):
                raise
            raise BackendUnreachable(f"{self.conn_id}: {type(exc).__name__}: {exc}") from exc
        finally:
            watchdog.cancel()

    def upload(self, steps: Sequence[UploadStep], job_dir: str) -> None:
        """Apply ``steps`` over one SFTP channel; failures are the job's ``SubmissionError``
        (each request bounded by ``command_timeout``, the whole by ``upload_timeout``)."""
        import paramiko

        client = self.client()
        deadline = time.monotonic() + self.upload_timeout
        watchdog = self._watchdog(self.upload_timeout + CONNECT_TIMEOUT)
        try:
            try:
                chan = client.get_transport().open_session(timeout=CONNECT_TIMEOUT)
                chan.settimeout(self.command_timeout)
                chan.invoke_subsystem("sftp")
                sftp = paramiko.SFTPClient(chan)
            except Exception as exc:
                self.close()
                raise SubmissionError(f"{self.conn_id}: SFTP unavailable: {exc}") from exc
            try:
                for step in steps:
                    _apply(sftp, step, deadline)
            except (OSError, EOFError, paramiko.SSHException) as exc:
                if isinstance(exc, UploadTimeout) or time.monotonic() > deadline:
                    self.close()
                    raise SubmissionError(f"{self.conn_id}: upload to {job_dir} did not finish "
                                          f"within {self.upload_timeout:g}s") from exc
                if isinstance(exc, TimeoutError):
                    self.close()
                    raise SubmissionError(f"{self.conn_id}: upload to {job_dir}: no answer "
                                          f"within {self.command_timeout:g}s") from exc
                raise SubmissionError(f"{self.conn_id}: upload to {job_dir} failed: {exc}") \
                    from exc
            finally:
                try:
                    sftp.close()
                except Exception:  # a channel the watchdog closed: nothing left to close
                    pass
        finally:
            watchdog.cancel()

    # --- async (triggerer) --------------------------------------------------------------------
    async def arun(self, script: str, timeout: float | None = None) -> tuple[int, str, str]:
        """Async :meth:`run` on one cached asyncssh connection (the triggerer's loop)."""
        from airflow.providers.ssh.hooks.ssh import SSHHookAsync

        timeout = timeout or self.command_timeout
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:
            try:
                if self._aconn is None:
                    self._ahook = SSHHookAsync(ssh_conn_id=self.conn_id)
                    self._aconn = await asyncio.wait_for(self._ahook.get_conn(), 20)
                result = await asyncio.wait_for(
                    self._aconn.run("bash -s", input=script, check=False), timeout)
            except Exception as exc:
                await self.aclose()
                raise BackendUnreachable(
                    f"cannot reach the login node of {self.conn_id}: "
                    f"{type(exc).__name__}: {exc}") from exc
        out = result.stdout if isinstance(result.stdout, str) else (result.stdout or b"").decode()
        err = result.stderr if isinstance(result.stderr, str) else (result.stderr or b"").decode()
        return result.exit_status or 0, out, err

    async def aclose(self) -> None:
        if self._aconn is not None:
            try:
                self._aconn.close()
            except Exception:  # closing a broken connection may raise; it is gone either way
                pass
            self._aconn = None


#: bytes per SFTP write of an uploaded file (paramiko's own put writes 32 KiB at a time)
_PUT_CHUNK = 32768


def _apply(sftp: Any, step: UploadStep, deadline: float = float("inf")) -> None:
    def in_time(*_: Any) -> None:
        if time.monotonic() > deadline:
            raise UploadTimeout("the upload ran past its time")

    in_time()
    if isinstance(step, MakeDirs):
        _makedirs(sftp, step.path, step.mode, in_tree=step.in_tree)
    elif isinstance(step, Chmod):
        sftp.chmod(step.path, step.mode)
    elif isinstance(step, WriteFile):
        with sftp.open(step.path, "w") as fh:
            sftp.chmod(step.path, step.mode)  # before any byte is written
            fh.write(step.content.encode())
    elif isinstance(step, MakeLink):
        _symlink(sftp, step.target, step.path)
    else:
        _put(sftp, step, in_time)


def _put(sftp: Any, step: PutFile, in_time: Any) -> None:
    """Written aside, then renamed over the path, as rsync does: a link already there (an
    earlier job's, the workdir's under a file mount) is replaced, never written through. The
    aside name is the upload's own (two jobs mounting one file at once do not share it; a
    long name is cut to fit 255 bytes) and removed if the upload fails."""
    base = posixpath.basename(step.remote).encode()[:200].decode(errors="ignore")
    part = posixpath.join(posixpath.dirname(step.remote),
                          f".{base}.{secrets.token_hex(4)}.airflow-skypilot-part")
    try:
        with open(step.local, "rb") as src, sftp.open(part, "w") as fh:
            sftp.chmod(part, stat.S_IMODE(os.fstat(src.fileno()).st_mode))
            fh.set_pipelined(True)  # as paramiko's put: writes acknowledged in the background
            while chunk := src.read(_PUT_CHUNK):
                fh.write(chunk)
                in_time()
        try:
            sftp.posix_rename(part, step.remote)
        except OSError as exc:
            if exc.errno is not None:
                raise
            # a server without OpenSSH's posix-rename ("Operation unsupported"): the plain
            # rename, which does not replace, after the link or file there is removed
            with contextlib.suppress(OSError):
                if not stat.S_ISDIR(sftp.lstat(step.remote).st_mode or 0):
                    sftp.remove(step.remote)
            sftp.rename(part, step.remote)
    except BaseException:
        with contextlib.suppress(Exception):
            sftp.remove(part)
        raise


def _symlink(sftp: Any, target: str, path: str) -> None:
    # paramiko sends (target, path): the order OpenSSH's sftp-server reads (the SFTP draft
    # has the reverse; servers do as OpenSSH does)
    try:
        sftp.symlink(target, path)
        return
    except TimeoutError:
        raise
    except OSError as exc:
        refused = exc
    # something is there already (an upload retried into the same job dir): rsync replaces
    # it, unless it is a folder. Asked only now: no extra request for every link
    try:
        there = sftp.lstat(path)
    except OSError:
        raise refused from None  # nothing there: the link itself was refused
    if there.st_mode is None or stat.S_ISDIR(there.st_mode):
        raise refused
    sftp.remove(path)
    sftp.symlink(target, path)


def _makedirs(sftp: Any, path: str, mode: int, in_tree: bool = False) -> None:
    parts = path.split("/")
    current = "/" if path.startswith("/") else ""
    last = max((i for i, part in enumerate(parts) if part), default=-1)
    for i, part in enumerate(parts):
        if not part:
            continue
        current = f"{current}{part}" if current.endswith("/") or not current else \
            f"{current}/{part}"
        if in_tree and i == last:
            # a tree's own folder: a link or a file there is replaced, as rsync does (the
            # parents, the destination, are followed)
            try:
                there = sftp.lstat(current)
            except OSError:
                sftp.mkdir(current, mode)
                continue
            if there.st_mode is not None and not stat.S_ISDIR(there.st_mode):
                sftp.remove(current)
                sftp.mkdir(current, mode)
            continue
        try:
            sftp.stat(current)
        except OSError:
            sftp.mkdir(current, mode)
