"""The tools a model may call in an episode: resolving them, running their calls, their observations.

    toolbox = resolve_tools(["python", "calculator", "my_tools:lookup"], timeout_s=10.0)
    calls = parse_tool_calls(turn_text)           # rollout/tool_calls.py: every <tool_call>{...}</tool_call> of a turn
    results = toolbox.execute(calls)              # one ToolResult per call, never raises for a model mistake

A model's mistake is an observation it can learn from, never an exception: a malformed block is
`parse_error`; an unknown tool, arguments that do not fit the schema, a tool that raises or passes
its deadline are `error`. Only a failure of ours (a sandbox that cannot start, a worker that died)
is `infra_error`, which the episode sampler turns into the row's `infra_error` Verdict.

Where each kind of tool runs:
  * `builtin` (`calculator`, `add`): trusted code of ours, in this process;
  * `callable` given by path (`module:function`, or a function object importable by its own
    path): in the worker pool (`rewards/pool.py`), with a soft deadline (SIGALRM in the worker's
    main thread: the worker survives) and a hard one (the pool kills the worker);
  * `callable` that cannot be imported by path (a lambda, a closure, a notebook's function): in
    this process, one call at a time in a thread joined with the deadline. A thread cannot be
    killed: one that passes its deadline is abandoned and keeps running in the background;
  * `sandbox` (`python`): model-written code, run as a program in a pool worker's bubblewrap slot
    (the code verifiers' slot, `rewards/code.py`), never in this process.
A callable's schema comes from its signature and Google-style docstring through transformers'
`get_json_schema`: the OpenAI function form `apply_chat_template(tools=...)` takes.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.errors import UserError
from posttrain.rewards.custom import load_error, resolve
from posttrain.rollout.calculator import CalculatorError, calculator
from posttrain.rollout.tool_calls import (ToolCall, ToolResult, argument_problem, cap_text, error_result, exception_text,
                                          result_text, timed_out_result)
from posttrain.rewards.pool import WorkerGone, get_pool
from posttrain.rewards.sandbox import SandboxConfig, SandboxUnavailable, check_isolation
from posttrain.rewards.sandbox_io import ProgramResult

logger = logging.getLogger(__name__)

MAX_TRACEBACK_CHARS = 1500
"""The python tool shows at most this much of the end of stderr when the program fails."""
WORKER_MARGIN_S = 30.0
"""A worker's hard deadline is the tool's deadline plus this: a fresh worker first imports this
module (and the user's), and a python call may first start its sandbox slot."""


# ---------------------------------------------------------------------------------------------
# The built-in tools (the calculator's evaluator: rollout/calculator.py).
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, no files kept) and return what it prints.

    Args:
        code: The program's source; print() what you want to see.
    """
    raise RuntimeError("the python tool runs in the sandbox (Toolbox.execute), not by calling this stub")


# ---------------------------------------------------------------------------------------------
# Running calls: in this process, in a worker, in a worker's sandbox.
class _Deadline(BaseException):
    """Raised by SIGALRM in a worker at a call's deadline (a BaseException: `except Exception` in
    the user's function does not swallow it)."""


def _call_in_thread(function: Callable, arguments: dict, timeout_s: float) -> ToolResult:
    """Call `function(**arguments)` in a daemon thread, waiting at most `timeout_s` (a late thread
    is abandoned: it cannot be killed)."""
    outcome: list[ToolResult] = []

    def target() -> None:
        try:
            outcome.append(ToolResult(result_text(function(**arguments)), "ok"))
        except BaseException as error:  # noqa: BLE001 - the tool's failure is the model's observation
            outcome.append(error_result(exception_text(error), "the tool raised"))

    thread = threading.Thread(target=target, daemon=True, name="posttrain-tool")
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else timed_out_result(timeout_s)


def _on_alarm(signum, frame) -> None:
    raise _Deadline()


def _call_with_alarm(function: Callable, arguments: dict, timeout_s: float) -> ToolResult:
    """Call `function(**arguments)` with a SIGALRM at `timeout_s` (main thread only; elsewhere
    without one: the pool's hard deadline still holds)."""
    if threading.current_thread() is not threading.main_thread():
        return _call_in_thread(function, arguments, timeout_s)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = function(**arguments)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return ToolResult(result_text(value), "ok")
    except _Deadline:
        return timed_out_result(timeout_s)
    except BaseException as error:  # noqa: BLE001 - the tool's failure is the model's observation
        return error_result(exception_text(error), "the tool raised")
    finally:
        signal.signal(signal.SIGALRM, previous)


def _run_callable(path: str, arguments: dict, timeout_s: float) -> ToolResult:
    """Worker trampoline: import `path` (not counted in the deadline) and call it with keywords."""
    return _call_with_alarm(resolve(path), arguments, timeout_s)


_TRACEBACK_FRAME = re.compile(r'^  File "<string>", line \d+, in _run_program\n', re.MULTILINE)


def program_observation(result: ProgramResult, timeout_s: float) -> ToolResult:
    """What the model sees of a python tool run: its stdout ("(no output)" when empty); when it
    failed, the end of stderr (the traceback, without the sandbox's own frame) or its exit status.

    >>> program_observation(ProgramResult(b"4\\n", b"", 0, ""), 5.0)
    ToolResult(content='4\\n', status='ok', reason='')
    >>> program_observation(ProgramResult(b"", b"", -9, "timed out after 5 s"), 5.0).content
    'error: timed out after 5s'
    """
    stdout = result.stdout.decode(errors="replace")
    printed = stdout if not stdout or stdout.endswith("\n") else stdout + "\n"  # what follows starts a line
    if result.reason.startswith("timed out"):
        timed_out = timed_out_result(timeout_s)
        return dataclasses.replace(timed_out, content=cap_text(printed + timed_out.content))
    if result.reason:
        return error_result(result.reason)
    if result.status == 0:
        return ToolResult(cap_text(stdout) if stdout else "(no output)", "ok")
    stderr = _TRACEBACK_FRAME.sub("", result.stderr.decode(errors="replace")).strip()
    stderr = stderr[-MAX_TRACEBACK_CHARS:] if stderr else (
        f"exit status {result.status}" if result.status is None or result.status >= 0 else f"killed by signal {-result.status}")
    return ToolResult(cap_text(printed + stderr), "error", "the program failed")


def _run_python(code: str, config: SandboxConfig) -> ToolResult:
    """Worker trampoline: run `code` as a program in this worker's sandbox slot (the code
    verifiers' slot: replaced and retried once when broken, then infra_error)."""
    from posttrain.rewards.code import with_slot
    from posttrain.rewards.verdict import Verdict

    outcome = with_slot(config, lambda slot: slot.run_program(code, b"", time.monotonic() + config.timeout_s))
    if isinstance(outcome, Verdict):
        return ToolResult("error: the sandbox failed", "infra_error", outcome.reason)
    return program_observation(outcome, config.timeout_s)


class Tool:
    """One tool: its schema (OpenAI function form) and how a batch of its calls runs."""

    kind = "builtin"
    isolation = "none (trusted, in the trainer's process)"

    def __init__(self, schema: dict, timeout_s: float, source: str):
        self.schema, self.timeout_s, self.source = schema, timeout_s, source
        self.name: str = schema["function"]["name"]

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters", {})

    def run(self, arguments: list[dict]) -> list[ToolResult]:
        """One result per arguments dict (already checked against the schema)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """The run card's entry."""
        return {"kind": self.kind, "source": self.source, "timeout_s": self.timeout_s, "isolation": self.isolation}


class InProcessTool(Tool):
    """A built-in, or a callable that cannot be imported by path: called here, one call at a time
    (it need not be thread-safe), each in a thread joined with the deadline."""

    def __init__(self, function: Callable, schema: dict, timeout_s: float, source: str, kind: str):
        super().__init__(schema, timeout_s, source)
        self.function, self.kind = function, kind
        if kind == "callable":
            self.isolation = "none (in the trainer's process, in a thread: one past its deadline cannot be killed)"

    def run(self, arguments: list[dict]) -> list[ToolResult]:
        """Each call in turn, in a thread with the deadline."""
        return [_call_in_thread(self.function, one, self.timeout_s) for one in arguments]


class WorkerTool(Tool):
    """A user callable imported by path in the worker pool: soft deadline by SIGALRM, hard
    deadline (+WORKER_MARGIN_S) by killing the worker; a worker that died is infra_error."""

    kind = "callable"
    isolation = "worker process (killed past its deadline)"

    def __init__(self, path: str, schema: dict, timeout_s: float, workers: int | None):
        super().__init__(schema, timeout_s, path)
        self.path, self.workers = path, workers

    def run(self, arguments: list[dict]) -> list[ToolResult]:
        """All calls through one pool map."""
        tasks = [(self.path, one, self.timeout_s) for one in arguments]
        return get_pool(self.workers).map(f"{__name__}:_run_callable", tasks, timeout_s=self.timeout_s + WORKER_MARGIN_S,
                                          on_failure=self._failure)

    def _failure(self, error: Exception) -> ToolResult:
        if isinstance(error, WorkerGone) and error.timed_out:
            return timed_out_result(self.timeout_s)  # ignored SIGALRM (stuck in C code): the pool killed it
        return ToolResult("error: the tool's worker failed", "infra_error", f"tool {self.name}: {error}")


class PythonTool(Tool):
    """Model-written Python run as a program in a pool worker's bubblewrap slot."""

    kind = "sandbox"

    def __init__(self, config: SandboxConfig, workers: int | None):
        super().__init__(_schema(python), config.timeout_s, "builtin")  # the stub's docstring
        self.config, self.workers = config, workers
        self.isolation = "none (--unsafe-no-sandbox)" if config.unsafe_no_sandbox else "bubblewrap"

    def run(self, arguments: list[dict]) -> list[ToolResult]:
        """All programs through one pool map; a worker late past the sandbox's own kill or dead is infra_error."""
        tasks = [(one["code"], self.config) for one in arguments]
        return get_pool(self.workers).map(f"{__name__}:_run_python", tasks, timeout_s=self.timeout_s + WORKER_MARGIN_S,
                                          on_failure=self._failure)

    def _failure(self, error: Exception) -> ToolResult:
        return ToolResult("error: the sandbox failed", "infra_error", f"tool python: {error}")

    def describe(self) -> dict[str, Any]:
        """The run card's entry, with the sandbox's limits."""
        return {**super().describe(), "sandbox": dataclasses.asdict(self.config)}


# ---------------------------------------------------------------------------------------------
# The toolbox.
class Toolbox:
    """The tools of a run: their schemas for the prompt, and `execute` for a turn's calls."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools = {tool.name: tool for tool in tools}
        self.names: list[str] = list(self.tools)

    def schemas(self) -> list[dict]:
        """The OpenAI function form of each tool: what `apply_chat_template(tools=...)` takes."""
        return [tool.schema for tool in self.tools.values()]

    def execute(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in order: the calls of a turn across all rows, each tool's calls
        run as one batch. A model's mistake is an error result, never an exception."""
        results: list[ToolResult | None] = [None] * len(calls)
        batches: dict[str, list[int]] = {}
        for index, call in enumerate(calls):
            results[index] = self._check(call)
            if results[index] is None:
                batches.setdefault(call.name, []).append(index)
        for name, indices in batches.items():
            started = time.monotonic()
            for index, result in zip(indices, self.tools[name].run([calls[i].arguments for i in indices])):
                results[index] = result
            logger.debug("tool %s: %d calls in %.2f s", name, len(indices), time.monotonic() - started)
        return results

    def _check(self, call: ToolCall) -> ToolResult | None:
        """The error result of a call that cannot run, or None."""
        if call.name is None:
            return ToolResult(f"error: malformed tool call: {call.error}", "parse_error", call.error or "")
        tool = self.tools.get(call.name)
        if tool is None:
            return error_result(f"unknown tool {call.name!r}; the tools are: {', '.join(self.names)}", "unknown tool")
        problem = argument_problem(call.arguments, tool.parameters)
        return error_result(f"{call.name}: {problem}", "bad arguments") if problem else None

    def describe(self) -> dict[str, Any]:
        """For the run card: each tool's kind, source, timeout and isolation, by name."""
        return {name: tool.describe() for name, tool in self.tools.items()}

    def close(self) -> None:
        """Nothing of its own to release: the worker pool and its sandbox slots are the process's
        (`rewards.pool.close_pools` at exit), and an abandoned thread cannot be stopped."""


def _schema(function: Callable) -> dict:
    from transformers.utils import get_json_schema  # transformers only when tools are resolved

    return get_json_schema(function)


def _importable_path(function: Callable) -> str | None:
    """`module:qualname` when that path imports back to this very function, else None."""
    module, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    try:
        return f"{module}:{qualname}" if resolve(f"{module}:{qualname}") is function else None
    except Exception:  # noqa: BLE001 - any import failure means "run it here"
        return None


@dataclass(frozen=True)
class _Spec:
    """What a spec names, before anything runs: its function (the python tool's: a stub giving its
    schema), the path a worker imports it by (None: not importable, or a built-in), its schema."""

    spec: str | Callable
    function: Callable
    path: str | None
    source: str
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


BUILTIN_TOOLS: dict[str, Callable] = {"python": python, "calculator": calculator, "add": add}
"""The built-in tools by name: their functions give their schemas (the python tool's is a stub)."""


def _read_spec(spec: str | Callable) -> _Spec:
    """The function, path and schema of one spec; a name, path or callable that gives none: UserError."""
    if isinstance(spec, str) and spec in BUILTIN_TOOLS:
        function, path, source = BUILTIN_TOOLS[spec], None, "builtin"
    elif isinstance(spec, str) and (":" in spec or "." in spec):
        problem = load_error(spec)
        if problem is not None:
            raise UserError(f"tool {spec}: {problem}")
        function, path, source = resolve(spec), spec, spec
    elif callable(spec):
        function, path = spec, _importable_path(spec)
        source = path or f"python:{getattr(spec, '__qualname__', type(spec).__name__)}"
    else:
        raise UserError(f"unknown tool {spec!r}: the built-in tools are {', '.join(BUILTIN_TOOLS)}; "
                        "a user tool is module:function")
    try:
        schema = _schema(function)
    except Exception as error:  # noqa: BLE001 - transformers' TypeHint/DocstringParsingException and friends
        raise UserError(f"tool {source}: cannot build its JSON schema from the signature and docstring: {error}") from None
    return _Spec(spec, function, path, source, schema)


def _read_specs(specs: Sequence[str | Callable]) -> list[_Spec]:
    """Every spec read; two tools with one name: UserError naming both."""
    read: list[_Spec] = []
    for spec in specs:
        one = _read_spec(spec)
        twin = next((other for other in read if other.name == one.name), None)
        if twin is not None:
            raise UserError(f"two tools are named {one.name!r} ({twin.source} and {one.source}): each tool needs its own name")
        read.append(one)
    return read


def tool_schemas(specs: Sequence[str | Callable]) -> list[dict]:
    """The schemas of `specs` (as `resolve_tools` reads them) with nothing started: no isolation
    check, no worker. For rendering transcripts (SFT) with the tools the model will be given."""
    return [one.schema for one in _read_specs(specs)]


def _build(one: _Spec, timeout_s: float, sandbox: SandboxConfig | None, workers: int | None) -> Tool:
    if one.spec == "python":
        config = dataclasses.replace(sandbox or SandboxConfig(), timeout_s=timeout_s)
        if config.unsafe_no_sandbox:
            logger.warning("tool python: UNSAFE, model-written code runs without bubblewrap (rlimits and uid only)")
        else:
            try:
                check_isolation()
            except SandboxUnavailable as error:
                raise UserError(f"tool python: {error}") from None
        return PythonTool(config, workers)
    if one.source == "builtin":
        return InProcessTool(one.function, one.schema, timeout_s, one.source, kind="builtin")
    if one.path is not None:
        return WorkerTool(one.path, one.schema, timeout_s, workers)
    logger.warning("tool %s cannot be imported by path (a lambda, a closure or defined in __main__): it runs in the "
                   "trainer's process, in a thread that cannot be killed past its %gs deadline", one.source, timeout_s)
    return InProcessTool(one.function, one.schema, timeout_s, one.source, kind="callable")


def resolve_tools(specs: Sequence[str | Callable], *, timeout_s: float = 10.0, sandbox: SandboxConfig | None = None,
                  workers: int | None = None) -> Toolbox:
    """The Toolbox for `specs`: "python" (the sandboxed Python tool), "calculator", "add",
    "module:function" (a user callable, run in the worker pool), or a Python callable (in the pool
    when importable by its own path, else in this process). `timeout_s` is each call's deadline
    (the python tool's sandbox budget too); `workers` sizes the pool (default: the CPU count).

    An unknown name, a path that does not import, a callable whose signature and docstring give
    no JSON schema, two tools with one name, or "python" where bubblewrap cannot isolate (and
    `sandbox.unsafe_no_sandbox` is not set): UserError, one line naming it.
    """
    return Toolbox([_build(one, timeout_s, sandbox, workers) for one in _read_specs(specs)])


def python_tool_rate(calls: int, *, code: str = "print(sum(range(1000)))", sandbox: SandboxConfig | None = None,
                     workers: int | None = None, timeout_s: float = 10.0) -> float:
    """Calls per second of the python tool: `calls` runs of `code` as one batch (as one episode
    turn's calls are), after one call that starts the sandbox slots. For bench/."""
    toolbox = resolve_tools(["python"], timeout_s=timeout_s, sandbox=sandbox, workers=workers)
    batch = [ToolCall("python", {"code": code})] * calls
    toolbox.execute(batch[:get_pool(workers).size])
    started = time.monotonic()
    results = toolbox.execute(batch)
    elapsed = time.monotonic() - started
    failed = [result for result in results if result.status != "ok"]
    if failed:
        raise RuntimeError(f"python tool: {len(failed)} of {calls} calls failed, e.g. {failed[0]}")
    return calls / elapsed
