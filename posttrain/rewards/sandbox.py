"""A bubblewrap sandbox slot for untrusted Python: the judge's side.

One `SandboxSlot` is one bwrap container holding a zygote (see `_zygote.py`). The judge (a pool
worker that holds the expected answers and never runs candidate code) asks the slot to fork a
child per sample and talks to it over pipes (`sandbox_io.py`: the pipes, their pump with caps and
a deadline, the function-call protocol); candidate results come back as typed plain data.

What the container gets (checked by tests/test_sandbox*.py against the real thing):
  * namespaces: new PID, network (no interfaces but a down loopback), IPC, UTS, cgroup, mount;
  * a read-only root holding only the interpreter's prefix (its site-packages hidden) and the
    shared libraries it links; no /etc, no home, no project files, no datasets;
  * a private size-capped /tmp (wiped after every sample), a minimal /dev, its own /proc;
  * an empty environment: bwrap itself is started with `env={}`, because `--clearenv` alone
    leaves the launcher's environment readable in /proc/<bwrap pid>/environ;
  * per child: its slot's own unprivileged uid (RLIMIT_NPROC is per uid and not enforced for
    root), address-space / CPU / file-size / open-file / process limits, a new session;
  * a wall-clock deadline, after which every process of that uid is killed, and capped
    stdout/stderr/result sizes.

Running as root, bwrap runs privileged and only the zygote keeps CAP_SETUID/SETGID; its children
drop to the slot uid before any candidate byte runs. As a normal user, bwrap makes a user
namespace; children then share the zygote's uid, so the slot is rebuilt after every sample.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from posttrain.rewards.sandbox_io import CandidateGone, FunctionSession, Pipes, ProgramResult, SlotBroken

logger = logging.getLogger(__name__)

ZYGOTE_SOURCE = Path(__file__).with_name("_zygote.py")
UID_BASE = 2_000_000  # far above any real account; one uid per live slot, claimed by a lock file
UID_COUNT = 4096
UID_LOCK_DIR = Path(tempfile.gettempdir()) / "posttrain-sandbox-uids"
START_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 10.0


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up here; untrusted code is refused (unless explicitly unsafe)."""


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sample. Frozen so a worker can tell when its slot must be rebuilt."""

    timeout_s: float = 10.0
    """wall-clock budget for one sample (all its calls / the whole program run)"""
    memory_mb: int = 1024
    """RLIMIT_AS of every candidate process"""
    file_size_mb: int = 16
    """RLIMIT_FSIZE: the largest file a candidate may write"""
    open_files: int = 64
    """RLIMIT_NOFILE"""
    processes: int = 32
    """RLIMIT_NPROC for the slot's uid (threads count too)"""
    tmp_mb: int = 16
    """size of the private /tmp"""
    output_bytes: int = 1 << 20
    """cap on stdout + stderr of one sample; past it the sample is killed (output flood)"""
    result_bytes: int = 8 << 20
    """cap on one encoded return value"""
    unsafe_no_sandbox: bool = False
    """run without bubblewrap (rlimits and uid only): never the default; the run card says so"""

    def rlimits(self) -> dict[str, int]:
        """The resource limits each candidate process gets, by `resource` constant name."""
        return {
            "RLIMIT_AS": self.memory_mb << 20,
            "RLIMIT_CPU": int(self.timeout_s) + 1,
            "RLIMIT_FSIZE": self.file_size_mb << 20,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_CORE": 0,
        }


# ---------------------------------------------------------------------------------------------
# What the container sees.
def interpreter() -> tuple[str, str]:
    """(real path of this Python's executable, its installation prefix) - the sandbox's Python."""
    return os.path.realpath(sys.executable), sys.base_prefix


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Real directories of the shared libraries the interpreter and its C extensions link."""
    executable, prefix = interpreter()
    objects = [executable] + [str(p) for p in Path(prefix).glob("lib/python3*/lib-dynload/*.so")]
    output = subprocess.run(["ldd", *objects], capture_output=True, text=True).stdout
    directories = set()
    for line in output.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else (parts[0] if parts else "")
        if path.startswith("/") and os.path.exists(path):
            # both the folder the loader looks in and the one the file really lives in
            for real in (os.path.realpath(os.path.dirname(path)),
                         os.path.dirname(os.path.realpath(path))):
                if not real.startswith(prefix + "/"):
                    directories.add(real)
    return tuple(sorted(directories))


def _mkdirs(path: str, done: set[str]) -> list[str]:
    """bwrap creates missing parents with mode 0700: create each with 0755 so the uid can pass."""
    args = []
    current = ""
    for part in Path(path).parts[1:-1]:
        current += "/" + part
        if current not in done:
            done.add(current)
            args += ["--perms", "0755", "--dir", current]
    return args


@functools.lru_cache(maxsize=1)
def _mount_args(tmp_mb: int) -> tuple[str, ...]:
    executable, prefix = interpreter()
    done: set[str] = set()
    args = []
    for top in ("/lib", "/lib64", "/lib32", "/libx32"):  # merged-/usr symlinks the loader follows
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
            done.add(top)
    for directory in (prefix, *_library_dirs()):
        args += _mkdirs(directory + "/x", done) + ["--ro-bind", directory, directory]
        done.add(directory)
    if not executable.startswith(prefix + "/"):
        folder = os.path.dirname(executable)
        args += _mkdirs(folder + "/x", done) + ["--ro-bind", folder, folder]
    for site in Path(prefix).glob("lib/python3*/site-packages"):
        args += ["--tmpfs", str(site)]  # the interpreter, not its installed packages
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
             "--perms", "1777", "--size", str(1 << 20), "--tmpfs", "/dev/shm",
             "--chdir", "/tmp", "--remount-ro", "/"]
    return tuple(args)


def bwrap_path() -> str | None:
    """The bubblewrap binary, or None."""
    return shutil.which("bwrap") or (os.path.exists("/usr/bin/bwrap") and "/usr/bin/bwrap") or None


def _privileged() -> bool:
    return os.geteuid() == 0


@functools.lru_cache(maxsize=None)
def check_isolation() -> str:
    """Start one real sandbox and return the bwrap version; raise SandboxUnavailable if it fails."""
    binary = bwrap_path()
    if binary is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: run `apt-get install -y bubblewrap`, "
            "or pass --unsafe-no-sandbox to run untrusted code without isolation"
        )
    slot = SandboxSlot(SandboxConfig())
    try:
        slot.start()
    except SlotBroken as error:
        raise SandboxUnavailable(
            f"bubblewrap cannot start a sandbox here ({error}); "
            "pass --unsafe-no-sandbox to run untrusted code without isolation"
        ) from None
    finally:
        slot.close()
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
    return version


# ---------------------------------------------------------------------------------------------
# One slot.
def _claim_uid() -> tuple[int, int]:
    """Claim an unused sandbox uid across processes with a lock file; returns (uid, lock fd)."""
    UID_LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    start = os.getpid() % UID_COUNT  # spread processes out so claims rarely collide
    for offset in range(UID_COUNT):
        uid = UID_BASE + (start + offset) % UID_COUNT
        fd = os.open(UID_LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise SlotBroken("no free sandbox uid")


class SandboxSlot:
    """One bwrap container with a zygote. Not thread-safe: one sample at a time."""

    def __init__(self, config: SandboxConfig):
        self.config = config
        self.process: subprocess.Popen | None = None
        self.control: socket.socket | None = None
        self.uid: int | None = None
        self._uid_lock: int | None = None
        self._stderr = None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the container and wait for the zygote's ready message (SlotBroken if not)."""
        if self.process is not None:
            return
        if _privileged() and self.uid is None:
            self.uid, self._uid_lock = _claim_uid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        zygote_config = {
            "control_fd": theirs.fileno(),
            "uid": self.uid,
            "gid": self.uid,
            "rlimits": self.config.rlimits(),
            "wipe": [] if self.config.unsafe_no_sandbox else ["/tmp", "/dev/shm"],
        }
        executable, _ = interpreter()
        command = [executable, "-I", "-S", "-B", "-X", "utf8", "-c", ZYGOTE_SOURCE.read_text(),
                   json.dumps(zygote_config)]
        if not self.config.unsafe_no_sandbox:
            command = self._bwrap_prefix() + command
        self._stderr = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(
                command, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=self._stderr, pass_fds=[theirs.fileno()], start_new_session=True,
                cwd="/" if not self.config.unsafe_no_sandbox else tempfile.gettempdir(),
            )
        except OSError as error:
            raise SlotBroken(f"cannot start the sandbox: {error}") from None
        finally:
            theirs.close()
        self.control = ours
        try:
            self._expect("ready", START_TIMEOUT_S)
        except SlotBroken:
            self.close()
            raise

    def _bwrap_prefix(self) -> list[str]:
        binary = bwrap_path()
        if binary is None:
            raise SlotBroken("bubblewrap is not installed")
        namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                      "--unshare-cgroup-try"]
        if _privileged():
            namespaces += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            namespaces += ["--unshare-user"]
        return [binary, *namespaces, "--die-with-parent", "--new-session", "--hostname", "sandbox",
                *_mount_args(self.config.tmp_mb)]

    def close(self) -> None:
        """Kill the container (its whole process group) and release the slot's uid."""
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
            self.process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._uid_lock is not None:
            os.close(self._uid_lock)
            self._uid_lock, self.uid = None, None

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read()[-300:].decode(errors="replace").strip()

    def _expect(self, op: str, timeout_s: float) -> dict:
        """The next control message named `op` ("exited" notices on the way are skipped)."""
        self.control.settimeout(timeout_s)
        while True:
            try:
                message = self.control.recv(1 << 16)
            except (OSError, socket.timeout) as error:
                raise SlotBroken(f"sandbox did not answer {op!r}: {error} {self._stderr_tail()}") from None
            if not message:
                raise SlotBroken(f"sandbox exited before {op!r}: {self._stderr_tail()}")
            reply = json.loads(message)
            if reply.get("op") == op:
                return reply
            if reply.get("op") != "exited":
                raise SlotBroken(f"sandbox answered {reply.get('op')!r}, expected {op!r}")

    # -- one sample ---------------------------------------------------------------------------
    def _launch(self, mode: str) -> Pipes:
        """Fork a child in the container with fresh pipes; returns our ends."""
        self.start()
        pipes = Pipes(timeout_s=self.config.timeout_s, output_bytes=self.config.output_bytes,
                      result_bytes=self.config.result_bytes)
        theirs = pipes.child_ends()
        try:
            socket.send_fds(self.control, [json.dumps({"op": "run", "mode": mode}).encode()], theirs)
        except OSError as error:
            pipes.close()
            raise SlotBroken(f"sandbox control channel failed: {error}") from None
        finally:
            for fd in theirs:
                os.close(fd)
        self._expect("started", FINISH_TIMEOUT_S)
        return pipes

    def finish(self, pipes: Pipes) -> int | None:
        """Kill what is left of the sample, wipe /tmp, return the child's exit status."""
        pipes.close()
        try:
            self.control.send(json.dumps({"op": "finish"}).encode())
            status = self._expect("done", FINISH_TIMEOUT_S)["status"]
        except OSError as error:
            raise SlotBroken(f"sandbox control channel failed: {error}") from None
        if self.uid is None and not self.config.unsafe_no_sandbox:
            self.close()  # children shared the zygote's uid: never reuse this container
        return status

    def open_function(self, code: str, entry_point: str, deadline: float) -> FunctionSession:
        """Load `code` in a fresh child and return a session whose `call(args)` runs entry_point."""
        pipes = self._launch("function")
        session = FunctionSession(pipes, deadline, self.finish)
        try:
            session.load(code, entry_point)
        except CandidateGone:
            session.close()
            raise
        return session

    def run_program(self, code: str, stdin: bytes, deadline: float) -> ProgramResult:
        """Run `code` as a __main__ program fed `stdin`; return its output (killed at deadline)."""
        pipes = self._launch("program")
        reason = ""
        try:
            header = (json.dumps({"code": code}) + "\n").encode()
            pipes.pump(deadline, writes={pipes.request: header, pipes.stdin: stdin}, until="exit",
                       control=self.control)
        except CandidateGone as gone:
            reason = str(gone)
        status = self.finish(pipes)
        return ProgramResult(bytes(pipes.out), bytes(pipes.err), status, reason)
