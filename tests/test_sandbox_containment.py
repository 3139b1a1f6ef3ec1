"""Containment tests against the real bubblewrap sandbox (no mocks).

Each probe is a small program run in a real slot; it prints what it managed to do as JSON and
the test asserts it managed nothing it should not have. Host-side checks (no surviving process
of the slot's uid, no connection on a listener we opened, no canary in any environ) are done
from outside.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path

import pytest

from posttrain.rewards.code import HumanEvalVerifier
from posttrain.rewards.sandbox import SandboxConfig, SandboxSlot, SandboxUnavailable, check_isolation

pytestmark = pytest.mark.timeout(120)
CANARY_NAME = "POSTTRAIN_TEST_CANARY"
CANARY = "canary-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def slot():
    try:
        check_isolation()
    except SandboxUnavailable as error:  # CI installs bubblewrap; a dev box without it skips
        pytest.skip(str(error))
    os.environ[CANARY_NAME] = CANARY  # set before the slot starts: it must not get in
    slot = SandboxSlot(SandboxConfig(timeout_s=3.0, tmp_mb=8))
    slot.start()
    yield slot
    slot.close()
    os.environ.pop(CANARY_NAME, None)


def run(slot: SandboxSlot, code: str, stdin: bytes = b"", timeout_s: float = 3.0):
    started = time.monotonic()
    result = slot.run_program(code, stdin, time.monotonic() + timeout_s)
    return result, time.monotonic() - started


def probe(slot: SandboxSlot, code: str) -> dict:
    result, _ = run(slot, "import json, os, sys\nreport = {}\n" + code + "\nprint(json.dumps(report))\n")
    assert result.reason == "", result
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


def uid_processes(uid: int) -> list[int]:
    """Host pids whose real uid is `uid` (the slot's uid is unique to the slot)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            line = next(l for l in status.splitlines() if l.startswith("Uid:"))
            if int(line.split()[1]) == uid:
                found.append(int(entry.name))
    return found


def assert_no_survivors(slot: SandboxSlot) -> None:
    if slot.uid is not None:
        assert uid_processes(slot.uid) == []


def test_honest_program_runs_and_sees_a_minimal_world(slot):
    report = probe(slot, "report['uid'] = os.getuid(); report['root'] = sorted(os.listdir('/'))\n"
                         "report['env'] = dict(os.environ); report['cwd'] = os.getcwd()")
    # the interpreter's prefix and library folders, /proc, /dev, /tmp: nothing else at the top
    assert {"dev", "proc", "tmp"} <= set(report["root"])
    assert set(report["root"]) <= {"dev", "proc", "tmp", "lib", "lib64", "lib32", "libx32", "usr", "root", "opt"}
    assert report["cwd"] == "/tmp"
    assert CANARY not in json.dumps(report["env"])
    if slot.uid is not None:
        assert report["uid"] == slot.uid != 0


def test_busy_loop_and_sleep_are_killed_at_the_deadline(slot):
    for code in ("while True:\n    pass\n", "import time\ntime.sleep(600)\n"):
        result, elapsed = run(slot, code, timeout_s=1.5)
        assert result.reason.startswith("timed out")
        assert elapsed < 1.5 + 5.0  # deadline + cleanup, with slack for a loaded CI box
        assert_no_survivors(slot)


def test_8gb_allocation_fails_inside(slot):
    report = probe(slot, "try:\n    block = bytearray(8 << 30)\n    report['allocated'] = True\n"
                         "except MemoryError:\n    report['allocated'] = False")
    assert report == {"allocated": False}


def test_fork_bomb_is_capped_and_leaves_no_survivors(slot):
    code = ("import os\nchildren = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
            "            import time; time.sleep(600); os._exit(0)\n        children += 1\n"
            "except OSError:\n    pass\nprint(children, flush=True)\nimport time; time.sleep(600)\n")
    result, _ = run(slot, code, timeout_s=2.0)
    assert result.reason.startswith("timed out")
    children = int(result.stdout.decode().split()[0])
    assert 0 < children < slot.config.processes
    assert_no_survivors(slot)


def test_thread_bomb_is_capped(slot):
    """Threads count against RLIMIT_NPROC and each new malloc arena against RLIMIT_AS: the bomb
    either stops with an error (fewer threads than the process limit) or wedges in
    Thread.start() after a MemoryError in the new thread and is killed at the deadline."""
    code = ("import json, os, threading, time\nthreads = 0\ntry:\n    while True:\n"
            "        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
            "        threads += 1\nexcept RuntimeError:\n    pass\n"
            "print(json.dumps({'threads': threads}), flush=True)\nos._exit(0)\n")
    result, elapsed = run(slot, code, timeout_s=2.0)
    if result.reason:
        assert result.reason.startswith("timed out") and elapsed < 2.0 + 5.0
    else:
        assert json.loads(result.stdout)["threads"] < slot.config.processes
    assert_no_survivors(slot)
    assert probe(slot, "report['alive'] = True") == {"alive": True}


def test_double_fork_daemon_does_not_survive_the_sample(slot):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(600)\n    os._exit(0)\ntime.sleep(0.2)\nprint('parent done')\n")
    result, _ = run(slot, code)
    assert result.stdout == b"parent done\n" and result.reason == ""
    assert_no_survivors(slot)


def test_writes_outside_tmp_fail_and_tmp_is_private(slot, tmp_path):
    targets = ["/etc/x", "/x", "/usr/x", "/root/x", "/proc/x", "/dev/x", os.path.realpath(os.__file__) + ".x",
               str(tmp_path / "x")]
    report = probe(slot, f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
                         "        report[path] = 'written'\n    except OSError as e:\n        report[path] = 'refused'\n"
                         "open('/tmp/mine', 'w').write('ok'); report['tmp'] = open('/tmp/mine').read()")
    assert report.pop("tmp") == "ok"
    assert set(report.values()) == {"refused"}, report
    assert not (tmp_path / "x").exists()
    # the next sample starts with an empty /tmp
    assert probe(slot, "report['tmp'] = os.listdir('/tmp')") == {"tmp": []}


def test_secrets_and_every_environ_are_out_of_reach(slot, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    paths = [str(secret), "/etc/passwd", "/etc/shadow", "/root/.bashrc", "/work/main/pyproject.toml",
             str(Path(__file__).resolve())]
    report = probe(slot, f"for path in {paths!r}:\n    try:\n        report[path] = open(path).read()[:100]\n"
                         "    except OSError:\n        report[path] = None\n"
                         "environs = []\nfor pid in os.listdir('/proc'):\n    try:\n"
                         "        environs.append(open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1'))\n"
                         "    except OSError:\n        pass\nreport['environ'] = environs\n"
                         "report['os.environ'] = dict(os.environ)")
    assert all(report[path] is None for path in paths), report
    assert CANARY not in json.dumps(report)
    assert os.environ[CANARY_NAME] == CANARY  # the canary really was in the launcher's environment


def test_no_network_no_dns(slot):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    report = probe(slot, f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                         "    report['connect'] = 'connected'\nexcept OSError as e:\n    report['connect'] = 'failed'\n"
                         "try:\n    socket.getaddrinfo('pypi.org', 443)\n    report['dns'] = 'resolved'\n"
                         "except OSError:\n    report['dns'] = 'failed'")
    assert report == {"connect": "failed", "dns": "failed"}
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_filling_tmp_stops_at_its_size(slot):
    report = probe(slot, "written = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        while True:\n"
                         "            f.write(b'x' * (1 << 20)); f.flush(); written += 1\n"
                         "except OSError as e:\n    report['error'] = type(e).__name__\nreport['mb'] = written")
    assert report["mb"] <= slot.config.tmp_mb
    assert report["error"] in ("OSError",)


def test_200mb_of_output_is_cut_off(slot):
    result, elapsed = run(slot, "import sys\nfor _ in range(200):\n    sys.stdout.write('x' * (1 << 20))\n",
                          timeout_s=10)
    assert result.reason.startswith("output flood")
    assert len(result.stdout) + len(result.stderr) <= slot.config.output_bytes + (1 << 16)
    assert elapsed < 10


def test_kill_minus_one_does_not_touch_other_slots():
    """Four killers and four slow honest candidates, two slots in parallel: honest ones score 1."""
    prompt = "def double(x):\n"
    test = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-1) == -2\n"
    example = {"prompt": prompt, "test": test, "entry_point": "double"}
    killer = "    import os, signal\n    for _ in range(50):\n        os.kill(-1, signal.SIGKILL)\n    return 2 * x\n"
    honest = "    import time\n    time.sleep(0.3)\n    return 2 * x\n"
    completions = [killer, honest] * 4
    verifier = HumanEvalVerifier(SandboxConfig(timeout_s=5.0))
    verdicts = verifier.batch(completions, [example] * len(completions), workers=2)
    assert [v.reward for v in verdicts[1::2]] == [1.0] * 4, verdicts
    assert all(v.status == "ok" for v in verdicts)


IO_EXAMPLE = {"entry_point": "double", "cases": [{"args": [2], "expected": 4}]}
IO_CODE = "def double(x):\n    return 2 * x\n"


def test_crashed_slot_is_replaced_and_the_sample_retried(slot):
    """Kill a live container from outside: the sample is retried once on a fresh one."""
    from posttrain.rewards import code

    config = SandboxConfig(timeout_s=3.0)
    broken = SandboxSlot(config)
    broken.start()
    os.killpg(broken.process.pid, 9)
    broken.process.wait()
    code._SLOT = broken
    try:
        verdict = code.IOVerifier(config).score(IO_CODE, IO_EXAMPLE)
        assert verdict.reward == 1.0 and verdict.status == "ok"
        assert code._SLOT is not broken
    finally:
        if code._SLOT is not None:
            code._SLOT.close()
        code._SLOT = None
        broken.close()


def test_slot_that_cannot_start_is_infra_error_after_a_retry(monkeypatch):
    from posttrain.rewards import code, sandbox, sandbox_io

    attempts = []

    def fail(self):
        attempts.append(1)
        raise sandbox_io.SlotBroken("bwrap: cannot mount (simulated)")

    monkeypatch.setattr(sandbox.SandboxSlot, "start", fail)
    verdict = code.IOVerifier(SandboxConfig(timeout_s=3.0)).score(IO_CODE, IO_EXAMPLE)
    code._SLOT = None
    assert verdict.status == "infra_error" and verdict.reward is None
    assert "sandbox failed twice" in verdict.reason and len(attempts) == 2


def test_refuses_without_bubblewrap_unless_unsafe(monkeypatch):
    from posttrain.rewards import sandbox

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    sandbox.check_isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="--unsafe-no-sandbox"):
            HumanEvalVerifier().prepare()
        unsafe = HumanEvalVerifier(SandboxConfig(unsafe_no_sandbox=True))
        example = {"prompt": "def double(x):\n", "entry_point": "double",
                   "test": "def check(candidate):\n    assert candidate(3) == 6\n"}
        assert unsafe("    return 2 * x\n", example).reward == 1.0
        assert unsafe.describe()["sandbox"].startswith("none")
    finally:
        sandbox.check_isolation.cache_clear()
