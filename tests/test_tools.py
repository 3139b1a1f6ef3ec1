"""The tools layer of episodes (posttrain/rollout/tools.py): parsing a turn's calls, the built-in
tools, user callables in the worker pool, the sandboxed python tool, and the rule that a model's
mistake is an observation (parse_error / error) while only our failures are infra_error."""

from __future__ import annotations

import os
import socket
import time

import pytest

from posttrain.errors import UserError
from posttrain.rewards.pool import WorkerGone
from posttrain.rewards.sandbox import SandboxConfig, SandboxSlot, SandboxUnavailable, check_isolation
from posttrain.rewards.sandbox_io import ProgramResult, SlotBroken
from posttrain.rollout import tools
from posttrain.rollout import tool_calls
from posttrain.rollout.tool_calls import ToolCall, ToolResult, parse_tool_calls
from posttrain.rollout.tools import calculator, resolve_tools

pytestmark = pytest.mark.timeout(180)
WORKERS = 1  # one worker: this machine's two cores are shared


# ---------------------------------------------------------------------------------------------
# Parsing.
PARSE_TABLE = [
    ("good call", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     [("add", {"a": 1, "b": 2}, None)]),
    ("two calls in one turn", 'First <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
     '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call> done',
     [("add", {"a": 1, "b": 2}, None), ("calculator", {"expression": "2*3"}, None)]),
    ("whitespace and newlines", '<tool_call>\n  {"name": "add",\n   "arguments": {"a": 1,\n "b": 2}}\n</tool_call>',
     [("add", {"a": 1, "b": 2}, None)]),
    ("arguments as a JSON string", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
     [("add", {"a": 1, "b": 2}, None)]),
    ("no arguments", '<tool_call>{"name": "nothing"}</tool_call>', [("nothing", {}, None)]),
    ("malformed JSON", '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
     [(None, {}, "invalid JSON: Expecting property name enclosed in double quotes: line 1 column 38 (char 37)")]),
    ("missing name", '<tool_call>{"arguments": {"a": 1}}</tool_call>', [(None, {}, 'missing "name" (a non-empty string)')]),
    ("arguments not an object", '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     [(None, {}, '"arguments" must be a JSON object, got list')]),
    ("not an object", '<tool_call>[1, 2]</tool_call>',
     [(None, {}, 'expected a JSON object {"name": ..., "arguments": {...}}, got list')]),
    ("unclosed block after a good one", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
     '<tool_call>{"name": "add", "arguments": {"a": 1', [("add", {"a": 1, "b": 2}, None), (None, {}, "block never closed (no </tool_call>)")]),
    ("no block", "The answer is 3.", []),
    ("a stray closing tag only", "3 </tool_call>", []),
]


@pytest.mark.parametrize("text, expected", [row[1:] for row in PARSE_TABLE], ids=[row[0] for row in PARSE_TABLE])
def test_parse_tool_calls(text, expected):
    assert parse_tool_calls(text) == [ToolCall(name, arguments, error) for name, arguments, error in expected]


# ---------------------------------------------------------------------------------------------
# The calculator: ast only, limits on size.
CALCULATOR_TABLE = [
    ("1 + 2 * 3", "7"),
    ("(1 + 2) * 3", "9"),
    ("-3 + +4", "1"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),            # a float that is exactly an integer prints as one
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("2 ** 10", "1024"),
    ("2 ** -1", "0.5"),
    ("0.1 + 0.2", "0.30000000000000004"),
    ("1.5e3 * 2", "3000"),
    ("2 ** 4000", str(2 ** 4000)),  # 4001 bits: under the cap
]


@pytest.mark.parametrize("expression, expected", CALCULATOR_TABLE)
def test_calculator(expression, expected):
    assert calculator(expression) == expected


CALCULATOR_REFUSED = [
    ("__import__('os').system('true')", "unsupported expression: Call"),
    ("(1).real", "unsupported expression: Attribute"),
    ("x + 1", "unsupported expression: Name"),
    ("'a' * 3", "unsupported expression: Constant"),
    ("True + 1", "unsupported expression: Constant"),
    ("1j * 1j", "unsupported expression: Constant"),
    ("[1, 2]", "unsupported expression: List"),
    ("2 ^ 3", "unsupported operator BitXor"),
    ("1 < 2", "unsupported expression: Compare"),
    ("9**9**9", "result too large"),                        # would never finish
    ("2 ** 5000", "result too large"),
    ("10.0 ** 400", "result too large"),                    # float overflow
    ("1e308 * 10", "result too large"),                     # inf
    ("*".join(["9999999999"] * 150), "result too large"),  # ~4980 bits: each product checked on the way
    ("(9**1000) * (9**1000)", "result too large"),
    ("2 ** 4100", "result too large"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "complex result"),
    ("1 +", "not an expression"),
    ("1" + "+1" * 1000, "expression longer than 2000"),
    ("-" * 1999 + "1", "nested too deeply"),
    ("(" * 300 + "1" + ")" * 300, "not an expression: too many nested parentheses"),
    ("1\x00", "not an expression"),
]


@pytest.mark.parametrize("expression, message", CALCULATOR_REFUSED, ids=[row[0][:30] for row in CALCULATOR_REFUSED])
def test_calculator_refuses(expression, message):
    started = time.monotonic()
    with pytest.raises(tools.CalculatorError, match=message.replace("(", r"\(").replace("*", r"\*")):
        calculator(expression)
    assert time.monotonic() - started < 2.0  # no exploit hangs it


def test_calculator_errors_are_observations():
    """A refused expression is the model's observation (status error), not an exception."""
    toolbox = resolve_tools(["calculator"])
    results = toolbox.execute([ToolCall("calculator", {"expression": "1 / 0"}),
                               ToolCall("calculator", {"expression": "__import__('os')"}),
                               ToolCall("calculator", {"expression": "2 * 21"})])
    assert results == [
        ToolResult("error: CalculatorError: division by zero", "error", "the tool raised"),
        ToolResult("error: CalculatorError: unsupported expression: Call (only numbers, + - * / // % ** and parentheses)",
                   "error", "the tool raised"),
        ToolResult("42", "ok"),
    ]


# ---------------------------------------------------------------------------------------------
# Schemas and arguments.
def test_add_schema_comes_from_its_signature_and_docstring():
    toolbox = resolve_tools(["add", "calculator"])
    assert toolbox.names == ["add", "calculator"]
    assert toolbox.schemas()[0] == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first integer."},
                                                        "b": {"type": "integer", "description": "The second integer."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}
    assert toolbox.schemas()[1]["function"]["parameters"]["required"] == ["expression"]
    assert toolbox.execute([ToolCall("add", {"a": 2, "b": 3})]) == [ToolResult("5", "ok")]


def test_user_callable_schema():
    toolbox = resolve_tools(["tests.tool_fixtures:lookup"], workers=WORKERS)
    assert toolbox.schemas() == [{"type": "function", "function": {
        "name": "lookup", "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key."},
                                                        "limit": {"type": "integer", "description": "How many values."}},
                       "required": ["key"]},
        "return": {"type": "object"}}}]
    assert toolbox.describe() == {"lookup": {"kind": "callable", "source": "tests.tool_fixtures:lookup", "timeout_s": 10.0,
                                             "isolation": "worker process (killed past its deadline)"}}


BAD_ARGUMENTS = [
    ({"a": 1}, "error: add: missing required argument 'b'"),
    ({"a": 1, "b": 2, "c": 3}, "error: add: unknown argument 'c' (arguments: a, b)"),
    ({"a": "1", "b": 2}, "error: add: argument 'a' must be integer, got string"),
    ({"a": 1.0, "b": 2}, "error: add: argument 'a' must be integer, got number"),
    ({"a": True, "b": 2}, "error: add: argument 'a' must be integer, got boolean"),
]


@pytest.mark.parametrize("arguments, content", BAD_ARGUMENTS)
def test_bad_arguments_name_the_argument(arguments, content):
    assert resolve_tools(["add"]).execute([ToolCall("add", arguments)]) == [ToolResult(content, "error", "bad arguments")]


def test_unknown_tool_and_parse_errors_are_observations():
    toolbox = resolve_tools(["add", "calculator"])
    calls = parse_tool_calls('<tool_call>{"name": "search", "arguments": {}}</tool_call>'
                             '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>'
                             '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    unknown, malformed, good = toolbox.execute(calls)
    assert unknown == ToolResult("error: unknown tool 'search'; the tools are: add, calculator", "error", "unknown tool")
    assert malformed.status == "parse_error"
    assert malformed.content.startswith("error: malformed tool call: invalid JSON: Expecting property name")
    assert good == ToolResult("2", "ok")


def test_argument_types_of_nested_schemas():
    parameters = {"properties": {"names": {"type": "array", "items": {"type": "string"}},
                                 "x": {"type": "number", "nullable": True},
                                 "mode": {"type": "string", "enum": ["a", "b"]},
                                 "u": {"type": ["integer", "string"]}}}
    assert tool_calls.argument_problem({"names": ["a"], "x": None, "mode": "a", "u": "s"}, parameters) is None
    assert tool_calls.argument_problem({"names": ["a", 2]}, parameters) == "argument 'names' item 1 must be string, got integer"
    assert tool_calls.argument_problem({"mode": "c"}, parameters) == "argument 'mode' must be one of ['a', 'b'], got 'c'"
    assert tool_calls.argument_problem({"u": 1.5}, parameters) == "argument 'u' must be integer or string, got number"


def test_result_text():
    assert [tool_calls.result_text(value) for value in ("text", None, 3, 2.5, True, [1, "a"], {"k": {"v": 1}}, (1, 2), {1, 2})] == [
        "text", "null", "3", "2.5", "true", '[1,"a"]', '{"k":{"v":1}}', "[1,2]", "{1, 2}"]
    long = tool_calls.result_text("x" * 20000)
    assert len(long) == tool_calls.MAX_CONTENT_CHARS and "...[cut]..." in long


# ---------------------------------------------------------------------------------------------
# User callables in the worker pool.
def test_user_callable_in_worker_returns_raises_and_times_out():
    """One batch: a value, an exception, a sleep past the 1 s deadline; then the next call still
    works on the same worker (the soft deadline, SIGALRM, did not kill it)."""
    toolbox = resolve_tools(["tests.tool_fixtures:multiply", "tests.tool_fixtures:fail", "tests.tool_fixtures:sleepy",
                             "tests.tool_fixtures:lookup", "tests.tool_fixtures:nothing"], timeout_s=1.0, workers=WORKERS)
    results = toolbox.execute([ToolCall("multiply", {"x": 6, "y": 7}), ToolCall("fail", {"message": "no such city"}),
                               ToolCall("sleepy", {"seconds": 30}), ToolCall("lookup", {"key": "k"}),
                               ToolCall("nothing", {}), ToolCall("multiply", {"x": 1.5, "y": 2})])
    assert results == [
        ToolResult("42", "ok"),
        ToolResult("error: ValueError: no such city", "error", "the tool raised"),
        ToolResult("error: timed out after 1s", "error", "timed out"),
        ToolResult('{"key":"k","values":[0,1]}', "ok"),
        ToolResult("null", "ok"),
        ToolResult("3.0", "ok"),
    ]
    assert toolbox.execute([ToolCall("sleepy", {"seconds": 0})]) == [ToolResult("awake", "ok")]


def test_user_callable_past_the_hard_deadline_is_killed(monkeypatch):
    """A call that ignores SIGALRM (stuck in C code) is killed by the pool at timeout + margin:
    still the model's `timed out`, and a fresh worker takes the next call."""
    monkeypatch.setattr(tools, "WORKER_MARGIN_S", 4.0)
    toolbox = resolve_tools(["tests.tool_fixtures:stubborn", "tests.tool_fixtures:multiply"], timeout_s=0.5, workers=WORKERS)
    assert toolbox.execute([ToolCall("multiply", {"x": 2, "y": 2})]) == [ToolResult("4", "ok")]  # worker warm
    started = time.monotonic()
    assert toolbox.execute([ToolCall("stubborn", {"seconds": 60})]) == [ToolResult("error: timed out after 0.5s", "error", "timed out")]
    assert time.monotonic() - started < 15
    monkeypatch.setattr(tools, "WORKER_MARGIN_S", 30.0)  # the fresh worker imports again
    assert toolbox.execute([ToolCall("multiply", {"x": 2, "y": 3})]) == [ToolResult("6", "ok")]


def test_a_worker_that_dies_is_infra_error():
    toolbox = resolve_tools(["tests.tool_fixtures:crash"], workers=WORKERS)
    [result] = toolbox.execute([ToolCall("crash", {"status": 3})])
    assert result.status == "infra_error"
    assert result.content == "error: the tool's worker failed"
    assert "worker died (exit status 3" in result.reason


def test_a_function_object_importable_by_path_runs_in_a_worker():
    from tests.tool_fixtures import multiply

    toolbox = resolve_tools([multiply], workers=WORKERS)
    assert toolbox.describe()["multiply"]["source"] == "tests.tool_fixtures:multiply"
    assert toolbox.execute([ToolCall("multiply", {"x": 3, "y": 3})]) == [ToolResult("9", "ok")]


def test_a_closure_runs_in_process_with_a_deadline(caplog):
    def shout(text: str) -> str:
        """Shout.

        Args:
            text: What to shout.
        """
        if text == "slow":
            time.sleep(3)
        return text.upper() + "!"

    with caplog.at_level("WARNING", logger="posttrain.rollout.tools"):
        toolbox = resolve_tools([shout], timeout_s=0.3)
    assert "cannot be imported by path" in caplog.text and "cannot be killed" in caplog.text
    assert toolbox.describe()["shout"]["kind"] == "callable"
    assert toolbox.execute([ToolCall("shout", {"text": "hi"}), ToolCall("shout", {"text": "slow"}),
                            ToolCall("shout", {"text": "ok"})]) == [
        ToolResult("HI!", "ok"), ToolResult("error: timed out after 0.3s", "error", "timed out"), ToolResult("OK!", "ok")]


# ---------------------------------------------------------------------------------------------
# resolve_tools: the user's mistakes, one line each.
@pytest.mark.parametrize("spec, message", [
    ("search", "unknown tool 'search': the built-in tools are python, calculator, add; a user tool is module:function"),
    ("tests.no_such_module:f", "tool tests.no_such_module:f: cannot load callable:tests.no_such_module:f: ModuleNotFoundError"),
    ("tests.tool_fixtures:missing", "tool tests.tool_fixtures:missing: cannot load callable"),
    ("tests.tool_fixtures:undocumented", "tool tests.tool_fixtures:undocumented: cannot build its JSON schema .* no description for the argument 'x'"),
])
def test_resolve_tools_errors_name_the_tool(spec, message):
    with pytest.raises(UserError, match=message) as raised:
        resolve_tools([spec])
    assert "\n" not in str(raised.value)


def test_two_tools_with_one_name():
    with pytest.raises(UserError, match="two tools are named 'add' \\(builtin and tests.tool_fixtures:add\\)"):
        resolve_tools(["add", "tests.tool_fixtures:add"])


def test_lambda_without_a_docstring_is_refused():
    with pytest.raises(UserError, match="cannot build its JSON schema .* no docstring"):
        resolve_tools([lambda x: x])


def test_python_tool_refused_without_isolation(monkeypatch):
    def unavailable():
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")

    monkeypatch.setattr(tools, "check_isolation", unavailable)
    with pytest.raises(UserError, match="tool python: bubblewrap \\(bwrap\\) is not installed"):
        resolve_tools(["python"])
    assert resolve_tools(["python"], sandbox=SandboxConfig(unsafe_no_sandbox=True)).describe()["python"]["isolation"] == \
        "none (--unsafe-no-sandbox)"


def test_tool_schemas_start_nothing(monkeypatch):
    """SFT renders transcripts with the schemas: no isolation check, no worker, the same schemas."""
    def unavailable():
        raise SandboxUnavailable("not here")

    specs = ["python", "calculator", "tests.tool_fixtures:multiply"]
    expected = resolve_tools(specs, workers=WORKERS).schemas()
    monkeypatch.setattr(tools, "check_isolation", unavailable)
    monkeypatch.setattr(tools, "get_pool", None)
    assert tools.tool_schemas(specs) == expected
    assert [schema["function"]["name"] for schema in expected] == ["python", "calculator", "multiply"]
    assert expected[0]["function"]["parameters"]["required"] == ["code"]
    with pytest.raises(UserError, match="two tools are named 'add'"):
        tools.tool_schemas(["add", "tests.tool_fixtures:add"])


# ---------------------------------------------------------------------------------------------
# Infra failures: never the model's fault, never an observation of an error it made.
def test_broken_sandbox_in_the_worker_is_infra_error(monkeypatch):
    """The worker's trampoline, called here with a slot whose every run fails: replaced, retried
    once, then infra_error (no candidate code runs: run_program is the broken part)."""
    def broken(self, code, stdin, deadline):
        raise SlotBroken("sandbox exited before 'started'")

    monkeypatch.setattr(SandboxSlot, "run_program", broken)
    result = tools._run_python("print(1)", SandboxConfig(timeout_s=1.0))
    assert result == ToolResult("error: the sandbox failed", "infra_error", "sandbox failed twice: sandbox exited before 'started'")


def test_dead_worker_of_the_python_tool_is_infra_error(monkeypatch):
    class DeadPool:
        size = 1

        def map(self, function, argument_tuples, timeout_s, retry_timeouts=False, on_failure=None):
            return [on_failure(WorkerGone("worker died (exit status -9)", timed_out=False)) for _ in argument_tuples]

    monkeypatch.setattr(tools, "get_pool", lambda size=None: DeadPool())
    toolbox = resolve_tools(["python", "add"], sandbox=SandboxConfig(unsafe_no_sandbox=True))
    assert toolbox.execute([ToolCall("python", {"code": "print(1)"}), ToolCall("add", {"a": 1, "b": 1})]) == [
        ToolResult("error: the sandbox failed", "infra_error", "tool python: worker died (exit status -9)"),
        ToolResult("2", "ok"),
    ]


@pytest.mark.parametrize("result, expected", [
    (ProgramResult(b"4\n", b"", 0, ""), ToolResult("4\n", "ok")),
    (ProgramResult(b"", b"", 0, ""), ToolResult("(no output)", "ok")),
    (ProgramResult(b"partial\n", b"Traceback (most recent call last):\n  File \"<string>\", line 149, in _run_program\n"
                   b"  File \"<candidate>\", line 1, in <module>\nZeroDivisionError: division by zero\n", 1, ""),
     ToolResult("partial\nTraceback (most recent call last):\n  File \"<candidate>\", line 1, in <module>\n"
                "ZeroDivisionError: division by zero", "error", "the program failed")),
    (ProgramResult(b"", b"", 3, ""), ToolResult("exit status 3", "error", "the program failed")),
    (ProgramResult(b"", b"", -9, ""), ToolResult("killed by signal 9", "error", "the program failed")),
    (ProgramResult(b"tick\n", b"", -9, "timed out after 2 s"), ToolResult("tick\nerror: timed out after 2s", "error", "timed out")),
    (ProgramResult(b"tick", b"", -9, "timed out after 2 s"), ToolResult("tick\nerror: timed out after 2s", "error", "timed out")),
    (ProgramResult(b"no newline", b"", 4, ""), ToolResult("no newline\nexit status 4", "error", "the program failed")),
    (ProgramResult(b"y\n" * 10, b"", -9, "output flood (over 20 bytes)"),
     ToolResult("error: output flood (over 20 bytes)", "error", "output flood (over 20 bytes)")),
])
def test_program_observation(result, expected):
    assert tools.program_observation(result, 2.0) == expected


# ---------------------------------------------------------------------------------------------
# The python tool against the real bubblewrap sandbox.
@pytest.fixture(scope="module")
def python_toolbox():
    try:
        check_isolation()
    except SandboxUnavailable as error:  # CI installs bubblewrap; a dev box without it skips
        pytest.skip(str(error))
    toolbox = resolve_tools(["python"], timeout_s=2.0, workers=WORKERS)
    yield toolbox
    toolbox.close()


def test_python_tool_prints_raises_and_times_out(python_toolbox):
    code = ["print(sum(range(10)))", "print('before')\n1 / 0", "while True:\n    pass", "import sys\nsys.exit(2)",
            "print('after')"]
    results = python_toolbox.execute([ToolCall("python", {"code": one}) for one in code])
    assert results[0] == ToolResult("45\n", "ok")
    assert results[1].status == "error"
    assert results[1].content.startswith("before\nTraceback (most recent call last):\n")
    assert results[1].content.endswith("ZeroDivisionError: division by zero")
    assert "_run_program" not in results[1].content  # the sandbox's own frame is not the model's business
    assert results[2] == ToolResult("error: timed out after 2s", "error", "timed out")
    assert results[3] == ToolResult("exit status 2", "error", "the program failed")
    assert results[4] == ToolResult("after\n", "ok")  # the slot survives a timeout


def test_python_tool_is_isolated(python_toolbox):
    """No network, no host files, no environment: the program runs in the sandbox, not here."""
    os.environ["POSTTRAIN_TOOL_CANARY"] = "canary-tools"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        code = {
            "socket": f"import socket\ns = socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))\nprint('connected')",
            "passwd": "print(open('/etc/passwd').read())",
            "project": f"print(open({os.path.abspath(__file__)!r}).read()[:20])",
            "environ": "import os\nprint(dict(os.environ))",
        }
        results = dict(zip(code, python_toolbox.execute([ToolCall("python", {"code": one}) for one in code.values()])))
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
        os.environ.pop("POSTTRAIN_TOOL_CANARY", None)
    assert results["socket"].status == "error" and "connected" not in results["socket"].content
    assert "OSError" in results["socket"].content or "Errno" in results["socket"].content
    assert results["passwd"].status == "error" and "FileNotFoundError" in results["passwd"].content
    assert results["project"].status == "error" and "FileNotFoundError" in results["project"].content
    assert results["environ"].status == "ok" and "canary" not in results["environ"].content


def test_python_tool_rate(python_toolbox):
    rate = tools.python_tool_rate(4, workers=WORKERS, timeout_s=2.0)
    assert rate > 0
