"""The judge's side of the conversation with one sandboxed child: its pipes and what comes back.

`Pipes` holds the judge's ends of a child's five pipes (stdin, stdout, stderr, requests, replies)
and pumps them with output caps and a deadline; `FunctionSession` speaks the request/reply
protocol of a loaded candidate function; `ProgramResult` is what a stdin/stdout program did.
The container itself, and the slots that start children in it, are `sandbox.py`; this module
knows only the caps it is given and the `finish` callback that ends a sample.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import socket
import time
from collections.abc import Callable

from posttrain.rewards._zygote import decode_value, encode_value


class SlotBroken(RuntimeError):
    """The sandbox itself failed (not the candidate): the caller replaces the slot and retries."""


class CandidateGone(Exception):
    """The candidate's process ended the conversation: timeout, exit, crash, output flood."""


@dataclasses.dataclass
class ProgramResult:
    """What a stdin/stdout program did. `reason` is empty unless it was stopped (timeout, flood)."""

    stdout: bytes
    stderr: bytes
    status: int | None
    reason: str


class FunctionSession:
    """A loaded candidate in a sandboxed child: `call(args)` -> ("value", v) or ("error", text).

    `finish(pipes)` ends the sample (kills the child, wipes /tmp) and returns its exit status:
    the slot that started the child passes its own `SandboxSlot.finish`.
    """

    def __init__(self, pipes: Pipes, deadline: float, finish: Callable[[Pipes], int | None]):
        self.pipes, self.deadline, self.finish = pipes, deadline, finish
        self.calls = 0
        self.closed = False

    def _exchange(self, request: dict) -> dict:
        line = (json.dumps(request) + "\n").encode()
        reply = self.pipes.pump(self.deadline, writes={self.pipes.request: line}, until="line")
        try:
            return json.loads(reply)
        except (ValueError, RecursionError):
            raise CandidateGone("garbled reply from the candidate process") from None

    def load(self, code: str, entry_point: str) -> None:
        """Send the code; raise CandidateGone if it fails to load (the reason names the error)."""
        reply = self._exchange({"code": code, "entry_point": entry_point})
        if "load_error" in reply:
            raise CandidateGone(f"code failed to load: {reply['load_error']}")
        if reply.get("ready") is not True:
            raise CandidateGone("candidate process sent something else than ready")

    def call(self, args: list) -> tuple[str, object]:
        """Call the entry point with `args` (plain data); the value comes back decoded, typed."""
        try:
            encoded = encode_value(list(args))
        except TypeError as error:
            raise ValueError(f"test argument cannot be sent to the sandbox: {error}") from None
        self.calls += 1
        reply = self._exchange({"args": encoded})
        if type(reply) is dict and type(reply.get("error")) is str:
            return "error", reply["error"]
        if type(reply) is not dict or "value" not in reply:
            raise CandidateGone("garbled reply from the candidate process")
        try:
            return "value", decode_value(reply["value"])
        except (ValueError, TypeError, RecursionError):
            raise CandidateGone("candidate returned malformed data") from None

    def close(self) -> int | None:
        """End the sample: kill the child and everything it started, wipe /tmp."""
        if self.closed:
            return None
        self.closed = True
        return self.finish(self.pipes)


class Pipes:
    """The judge's ends of one child's five pipes, and an I/O pump with caps and a deadline.

    `output_bytes` caps stdout + stderr together, `result_bytes` one reply line; `timeout_s` is the
    sample's budget, named in the timeout reason.
    """

    def __init__(self, *, timeout_s: float, output_bytes: int, result_bytes: int):
        self.timeout_s, self.output_bytes, self.result_bytes = timeout_s, output_bytes, result_bytes
        self.stdin_read, self.stdin = os.pipe()
        self.out_fd, self.out_write = os.pipe()
        self.err_fd, self.err_write = os.pipe()
        self.request_read, self.request = os.pipe()
        self.reply_fd, self.reply_write = os.pipe()
        for fd in (self.stdin, self.request, self.out_fd, self.err_fd, self.reply_fd):
            os.set_blocking(fd, False)
        self.out = bytearray()
        self.err = bytearray()
        self.reply = bytearray()
        self.open_reads = {self.out_fd, self.err_fd, self.reply_fd}
        self.open_writes = {self.stdin, self.request}

    def child_ends(self) -> list[int]:
        """The child's fds 0-4: stdin, stdout, stderr, requests, replies (caller closes them)."""
        ends = [self.stdin_read, self.out_write, self.err_write, self.request_read, self.reply_write]
        self.stdin_read = self.out_write = self.err_write = self.request_read = self.reply_write = -1
        return ends

    def close(self) -> None:
        """Close our ends."""
        for fd in self.open_reads | self.open_writes:
            os.close(fd)
        self.open_reads, self.open_writes = set(), set()

    def pump(self, deadline: float, writes: dict[int, bytes], until: str,
             control: socket.socket | None = None) -> bytes:
        """Write `writes`, read everything, until a reply line (`until="line"`) or until the
        child process exits (`"exit"`: the zygote says so on `control`; stdin is closed once
        written, and a daemon still holding stdout does not keep us waiting). Raises
        CandidateGone on deadline, output flood or an oversized reply."""
        pending = {fd: memoryview(data) for fd, data in writes.items() if fd in self.open_writes}
        close_after = {self.stdin} if until == "exit" else set()
        with selectors.DefaultSelector() as selector:
            for fd in self.open_reads:
                selector.register(fd, selectors.EVENT_READ)
            if control is not None:
                selector.register(control, selectors.EVENT_READ)
            for fd in pending:
                selector.register(fd, selectors.EVENT_WRITE)
            for fd in close_after - set(pending):
                self._close_write(fd)
            while True:
                if until == "line" and b"\n" in self.reply:
                    line, _, rest = bytes(self.reply).partition(b"\n")
                    self.reply = bytearray(rest)
                    return line
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CandidateGone(f"timed out after {self.timeout_s:g} s")
                for key, _ in selector.select(remaining):
                    fd = key.fd
                    if control is not None and fd == control.fileno():
                        message = control.recv(1 << 16)
                        if not message or json.loads(message).get("op") != "exited":
                            raise SlotBroken(f"unexpected control message {message[:80]!r}")
                        self._drain()
                        return b""
                    if fd in pending:
                        try:
                            written = os.write(fd, pending[fd])
                        except BrokenPipeError:
                            written = len(pending[fd])
                        pending[fd] = pending[fd][written:]
                        if not pending[fd]:
                            selector.unregister(fd)
                            del pending[fd]
                            if fd in close_after:
                                self._close_write(fd)
                        continue
                    data = os.read(fd, 1 << 16)
                    if not data:
                        selector.unregister(fd)
                        self.open_reads.discard(fd)
                        os.close(fd)
                        if fd == self.reply_fd and until == "line":
                            raise CandidateGone("the candidate process exited")
                        continue
                    if fd == self.reply_fd:
                        self.reply += data
                        if len(self.reply) > self.result_bytes:
                            raise CandidateGone("result larger than the cap")
                    else:
                        (self.out if fd == self.out_fd else self.err).extend(data)
                        if len(self.out) + len(self.err) > self.output_bytes:
                            raise CandidateGone(f"output flood (over {self.output_bytes} bytes)")

    def _drain(self) -> None:
        """Read what the exited child left in stdout/stderr (non-blocking; daemons are ignored)."""
        for fd, buffer in ((self.out_fd, self.out), (self.err_fd, self.err)):
            while fd in self.open_reads and len(self.out) + len(self.err) <= self.output_bytes:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    break
                if not data:
                    break
                buffer.extend(data)
        if len(self.out) + len(self.err) > self.output_bytes:
            raise CandidateGone(f"output flood (over {self.output_bytes} bytes)")

    def _close_write(self, fd: int) -> None:
        if fd in self.open_writes:
            self.open_writes.discard(fd)
            os.close(fd)
