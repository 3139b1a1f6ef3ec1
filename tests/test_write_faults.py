"""A run directory whose disk fills or whose files cannot grow (issue 19).

Faults are real: a subprocess whose file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) is below what it
writes gets EFBIG from `write`, and a tmpfs of a few MiB mounted in a private mount namespace
(`unshare -m`, needs root: skipped otherwise) gets ENOSPC. Each failure must be one line naming the
file, the error and the free space, leave no temporary file, and leave the complete checkpoints and
whole log lines as they were.
"""

import functools
import json
import logging
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.atomic import write_atomically
from posttrain.errors import WriteFailed, format_bytes, write_errno, write_failed
from posttrain.runs import (
    RunDirectory, latest_checkpoint, load_trainer_state, plot_metrics, read_jsonl, verify_checkpoint, write_step_checkpoint,
)
from posttrain.runs import checkpoint as checkpoint_module

ROOT = Path(__file__).resolve().parent.parent
FREE = r"\([\d.]+ (B|KiB|MiB|GiB|TiB) free on /[^)]*\)"  # the free space and the mount point it is on


def file_size_limit(limit: int):
    """preexec_fn: writes past `limit` bytes fail with EFBIG (not SIGXFSZ, which would kill the child)."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def python(code: str, limit: int, *arguments: str) -> subprocess.CompletedProcess:
    """Run `code` in a child whose files may not pass `limit` bytes."""
    return subprocess.run([sys.executable, "-c", code, *arguments], capture_output=True, text=True, cwd=ROOT,
                          preexec_fn=file_size_limit(limit), timeout=120)


@functools.cache
def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(not can_mount_tmpfs(), reason="cannot mount a tmpfs in a private mount namespace (needs root and unshare)")


def on_small_filesystem(mount: Path, size: int, *command: str, **kwargs) -> subprocess.CompletedProcess:
    """Run `command` with a `size`-byte tmpfs on `mount`, seen by it alone and gone when it ends."""
    mount.mkdir(exist_ok=True)
    script = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(size), str(mount), *command],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, **kwargs)


def write_weights(value: float, count: int):
    def write(directory):
        (directory / "model").mkdir()
        torch.save({"w": torch.full((count,), float(value))}, directory / "model" / "weights.pt")
    return write


# --- checkpoints -----------------------------------------------------------------------------------

WRITE_WEIGHTS = """
def write_weights(value, count):
    def write(directory):
        (directory / "model").mkdir()
        torch.save({"w": torch.full((count,), float(value))}, directory / "model" / "weights.pt")
    return write
"""

CHECKPOINT_PAST_THE_LIMIT = """
import json, sys, torch
from pathlib import Path
from posttrain.errors import WriteFailed
from posttrain.runs import write_step_checkpoint
""" + WRITE_WEIGHTS + """
results = []
for directory, models, state in [
    (sys.argv[1], write_weights(2, 100), {"big": torch.zeros(100_000)}),  # trainer_state.pt: 400 KB, past 64 KiB
    (sys.argv[2], write_weights(2, 100_000), {}),                         # model/weights.pt, through torch.save(path)
]:
    try:
        write_step_checkpoint(directory, 2, models, state)
        results.append(None)
    except WriteFailed as error:
        results.append([str(error), error.exit_code])
print(json.dumps(results))
"""


def test_checkpoint_past_the_file_size_limit_is_one_line_and_leaves_the_previous_one(tmp_path):
    """Step 1 (a 400-byte model) is written here; step 2 in a child that may not write a file over
    64 KiB. trainer_state.pt is written through a file object, so its errno (EFBIG: "File too large")
    is known; a model written by torch.save to a path hides it ("torch's writer failed")."""
    state_dir, model_dir = tmp_path / "state", tmp_path / "model"
    for directory in (state_dir, model_dir):
        write_step_checkpoint(directory, 1, write_weights(1, 100), {"data_position": 10})
    result = python(CHECKPOINT_PAST_THE_LIMIT, 65536, str(state_dir), str(model_dir))
    assert result.returncode == 0, result.stderr
    (state_message, state_code), (model_message, model_code) = json.loads(result.stdout.splitlines()[-1])
    assert re.fullmatch(rf"cannot write {re.escape(str(state_dir))}/\.tmp-step-000002-\d+/trainer_state\.pt: File too large {FREE}",
                        state_message), state_message
    assert re.fullmatch(rf"cannot write {re.escape(str(model_dir))}/\.tmp-step-000002-\d+: torch's writer failed \(\[enforce fail at "
                        rf"inline_container\.cc:\d+\] \. unexpected pos \d+ vs \d+\) {FREE}", model_message), model_message
    assert state_code == model_code == 74
    for directory in (state_dir, model_dir):
        assert sorted(p.name for p in directory.iterdir()) == ["step-000001"]  # no .tmp- left, nothing else
        assert verify_checkpoint(directory / "step-000001") is None
        assert latest_checkpoint(directory).name == "step-000001"
        assert load_trainer_state(directory / "step-000001")["data_position"] == 10


FILL_SMALL_FILESYSTEM = """
import json, logging, sys, torch
from pathlib import Path
from posttrain.errors import WriteFailed
from posttrain.runs import verify_checkpoint, write_step_checkpoint
""" + WRITE_WEIGHTS + """
logging.basicConfig(level=logging.WARNING, format="%(message)s")
checkpoints = Path(sys.argv[1])
first = write_step_checkpoint(checkpoints, 1, write_weights(1, 120_000), {})  # 480 KB of a 1 MiB filesystem
try:
    write_step_checkpoint(checkpoints, 2, write_weights(2, 100), {"big": torch.zeros(200_000)})  # 800 KB: no room
    message = None
except WriteFailed as error:
    message = str(error)
print(json.dumps({"message": message, "names": sorted(p.name for p in checkpoints.iterdir()),
                  "verifies": verify_checkpoint(first) is None,
                  "first_bytes": sum(entry["bytes"] for entry in json.loads((first / "MANIFEST.json").read_text())["files"].values())}))
"""


@needs_tmpfs
def test_checkpoint_on_a_full_filesystem_is_one_line_and_leaves_the_previous_one(tmp_path):
    """A 1 MiB tmpfs holds step 1 (480 KB); before step 2 the warning says that the ~540 KiB left is
    under 1.5 x 480 KB; step 2 (an 800 KB trainer_state.pt) fails with ENOSPC, measured while the
    partial file still fills the disk, and its temporary directory is gone."""
    mount = tmp_path / "small"
    result = on_small_filesystem(mount, 2**20, sys.executable, "-c", FILL_SMALL_FILESYSTEM, str(mount / "checkpoints"))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    where = re.escape(str(mount))
    assert re.fullmatch(rf"cannot write {where}/checkpoints/\.tmp-step-000002-\d+/trainer_state\.pt: No space left on device "
                        rf"\(0 B free on {where}\)", outcome["message"]), outcome["message"]
    assert outcome["names"] == ["step-000001"] and outcome["verifies"]
    assert 480_000 < outcome["first_bytes"] < 484_000  # 120,000 float32 and two torch.save zips' headers
    warning = re.search(rf"{where}/checkpoints: ([\d.]+) KiB free on {where}, and the last checkpoint \(step-000001\) "
                        rf"took {re.escape(format_bytes(outcome['first_bytes']))}: the next one may not fit", result.stderr)
    assert warning and float(warning.group(1)) < 1.5 * outcome["first_bytes"] / 1024, result.stderr


def test_free_space_warning_names_both_numbers(tmp_path, monkeypatch, caplog):
    """The warning compares the free space with the newest complete checkpoint's manifest bytes
    (the model file and trainer_state.pt), and is silent with room to spare."""
    first = write_step_checkpoint(tmp_path, 1, write_weights(1, 1000), {})
    size = sum(p.stat().st_size for p in first.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    with caplog.at_level(logging.WARNING):
        write_step_checkpoint(tmp_path, 2, write_weights(2, 1000), {})  # the real disk: room to spare
    assert "may not fit" not in caplog.text
    monkeypatch.setattr(checkpoint_module, "free_space", lambda path: (Path("/mnt/runs"), int(1.4 * size)))
    with caplog.at_level(logging.WARNING):
        write_step_checkpoint(tmp_path, 3, write_weights(3, 1000), {})
    assert (f"{tmp_path}: {format_bytes(int(1.4 * size))} free on /mnt/runs, and the last checkpoint (step-000002) "
            f"took {format_bytes(size)}: the next one may not fit") in caplog.text


def test_an_interrupted_checkpoint_removes_its_temporary_directory_and_other_errors_pass_through(tmp_path):
    def broken(directory):
        (directory / "model").mkdir()
        (directory / "model" / "part").write_bytes(b"x" * 100)
        raise ValueError("a bug in write_models")

    write_step_checkpoint(tmp_path, 1, write_weights(1, 10), {})
    with pytest.raises(ValueError, match="a bug in write_models"):
        write_step_checkpoint(tmp_path, 2, broken, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


# --- metrics.jsonl and samples.jsonl ---------------------------------------------------------------

APPEND_PAST_THE_LIMIT = """
import json, sys
from posttrain.errors import WriteFailed
from posttrain.runs import RunDirectory
run = RunDirectory(sys.argv[1], resume=True)
messages = []
for log in (lambda: run.log_metrics(3, {"loss": 0.25, "note": "x" * 200}),
            lambda: run.log_samples(3, [{"prompt": "p", "completion": "c" * 30}] * 8)):
    try:
        log()
        messages.append(None)
    except WriteFailed as error:
        messages.append(str(error))
print(json.dumps(messages))
"""


def test_an_append_that_fails_leaves_whole_lines_only(tmp_path):
    """In the child no file may grow past 40 bytes more than the longer log: the kernel writes the new
    lines up to that limit (a short write), the next write gets EFBIG, and the file is cut back to its
    previous bytes."""
    run = RunDirectory(tmp_path / "run")
    (run.path / "config.yaml").write_text("a: 1\n")
    for step in (1, 2):
        run.log_metrics(step, {"loss": 1.0 / step})
        run.log_samples(step, [{"prompt": "p", "completion": str(step)}])
    metrics, samples = run.path / "metrics.jsonl", run.path / "samples.jsonl"
    before = {path: path.read_bytes() for path in (metrics, samples)}
    limit = max(len(data) for data in before.values()) + 40
    result = python(APPEND_PAST_THE_LIMIT, limit, str(run.path))
    assert result.returncode == 0, result.stderr
    metrics_message, samples_message = json.loads(result.stdout.splitlines()[-1])
    assert re.fullmatch(rf"cannot write {re.escape(str(metrics))}: File too large {FREE}", metrics_message), metrics_message
    assert re.fullmatch(rf"cannot write {re.escape(str(samples))}: File too large {FREE}", samples_message), samples_message
    assert {path: path.read_bytes() for path in (metrics, samples)} == before
    assert [row["step"] for row in read_jsonl(metrics)] == [1, 2] and [row["completion"] for row in read_jsonl(samples)] == ["1", "2"]


def test_log_samples_writes_a_step_in_one_append(tmp_path):
    run = RunDirectory(tmp_path / "run")
    run.log_samples(4, [{"prompt": "a"}, {"prompt": "b", "reward": float("inf")}])
    assert (run.path / "samples.jsonl").read_text() == '{"step": 4, "prompt": "a"}\n{"step": 4, "prompt": "b", "reward": null}\n'


def test_a_torn_last_line_is_dropped_on_resume_with_a_warning(tmp_path, caplog):
    """A crash (or power loss) mid-line leaves `{"step": 4, "loss": 0.` with no newline; resuming from
    step 3 keeps lines 1-3 byte for byte, warns naming the file and line 4, and leaves no temp file."""
    run = RunDirectory(tmp_path / "run")
    (run.path / "config.yaml").write_text("a: 1\n")
    for step in (1, 2, 3):
        run.log_metrics(step, {"loss": 1.0 / step})
    whole = (run.path / "metrics.jsonl").read_text()
    with (run.path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "loss": 0.')
    resumed = RunDirectory(tmp_path / "run", resume=True)
    with caplog.at_level(logging.WARNING):
        resumed.truncate_logs(3)
    assert f"{run.path / 'metrics.jsonl'}: line 4 is not a whole JSON row (torn by a crash mid-write?): ignored" in caplog.text
    assert (run.path / "metrics.jsonl").read_text() == whole == "".join(
        json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in (1, 2, 3))
    assert sorted(p.name for p in run.path.iterdir()) == ["checkpoints", "config.yaml", "eval", "metrics.jsonl", "plots"]
    resumed.log_metrics(4, {"loss": 0.25})
    assert [row["step"] for row in read_jsonl(run.path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_write_failed_reads_the_errno_behind_torch_and_rust_errors(tmp_path):
    """torch.save to a file object: a RuntimeError whose context is the OSError; safetensors: Rust's
    "(os error 28)"; a read error (ENOENT) is no write failure."""
    try:
        try:
            raise OSError(27, "File too large")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as error:
        assert write_errno(error) == 27
    assert write_errno(Exception("Error while serializing: I/O error: No space left on device (os error 28)")) == 28
    assert write_errno(FileNotFoundError(2, "No such file or directory")) is None
    failure = write_failed(OSError(28, "No space left on device"), tmp_path / "absent" / "eval.json")
    assert isinstance(failure, WriteFailed) and failure.exit_code == 74
    assert re.fullmatch(rf"cannot write {re.escape(str(tmp_path))}/absent/eval\.json: No space left on device {FREE}", str(failure))


PLOT_PAST_THE_LIMIT = """
import sys
from posttrain.errors import WriteFailed
from posttrain.runs import plot_metrics
try:
    plot_metrics([{"step": s, "loss": 1 / (s + 1)} for s in range(50)], ["loss"], sys.argv[1])
except WriteFailed as error:
    print(error)
"""


def test_a_plot_that_cannot_be_written_leaves_the_previous_one(tmp_path):
    """A refreshed plot goes through a temporary PNG: past a 4 KiB file-size limit the previous
    loss.png is left byte for byte, no temporary PNG stays, and the error names loss.png."""
    (previous,) = plot_metrics([{"step": s, "loss": 1.0} for s in range(2)], ["loss"], tmp_path)
    before = previous.read_bytes()
    result = python(PLOT_PAST_THE_LIMIT, 4096, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"cannot write {re.escape(str(previous))}: File too large {FREE}", result.stdout.strip()), result.stdout
    assert previous.read_bytes() == before and len(before) > 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]


TORCH_SAVE_PAST_THE_LIMIT = """
import sys, torch
from posttrain.atomic import write_atomically
from posttrain.errors import WriteFailed
try:
    write_atomically(sys.argv[1], lambda handle: torch.save({"train": torch.zeros(100_000, 2)}, handle))
except WriteFailed as error:
    print(error)
"""


def test_a_reference_cache_that_cannot_be_written_leaves_the_previous_one(tmp_path):
    """The DPO reference cache is a torch.save through `write_atomically` (torch's writer raises a
    RuntimeError over the OSError): 800 KB of log-probs past a 64 KiB file-size limit is one line
    naming the cache, the previous file is left byte for byte and no temporary file stays."""
    cache = tmp_path / "reference_logprobs.pt"
    write_atomically(cache, lambda handle: torch.save({"train": torch.ones(3, 2), "fingerprint": "f"}, handle))
    before = cache.read_bytes()
    result = python(TORCH_SAVE_PAST_THE_LIMIT, 64 * 2**10, str(cache))
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"cannot write {re.escape(str(cache))}: File too large {FREE}", result.stdout.strip()), result.stdout
    assert cache.read_bytes() == before and torch.load(cache, weights_only=True)["fingerprint"] == "f"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference_logprobs.pt"]

# --- the command line ------------------------------------------------------------------------------

SFT = [sys.executable, "-m", "posttrain", "sft", "--data.task", "arithmetic", "--data.train_size", "64",
       "--data.eval_size", "4", "--batch_size", "4", "--micro_batch_size", "4"]


def test_cli_checkpoint_past_the_file_size_limit_is_one_line_and_exit_74(tmp_path):
    """A 1-step tiny SFT whose checkpoint (13 MB of weights) cannot be written under a 2 MiB file-size
    limit: exit 74, the last line of stderr the one-line error, no traceback, no temporary directory,
    and metrics.jsonl (written before the checkpoint) whole."""
    run = tmp_path / "run"
    result = subprocess.run([*SFT, "--max-steps", "1", "--output-dir", str(run)], capture_output=True, text=True,
                            cwd=ROOT, preexec_fn=file_size_limit(2 * 2**20), timeout=300)
    assert result.returncode == 74, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"posttrain: error: cannot write {re.escape(str(run))}/checkpoints/\.tmp-step-000001-\d+: File too large {FREE}", last), last
    assert "Traceback" not in result.stderr
    assert list((run / "checkpoints").iterdir()) == []
    assert [row["step"] for row in read_jsonl(run / "metrics.jsonl")] == [1]


@needs_tmpfs
def test_cli_on_a_full_filesystem_keeps_the_previous_checkpoint(tmp_path):
    """A 2-step tiny SFT, checkpointing each step, on a tmpfs of 1.5x one checkpoint (weights and
    Adam's two moments: 3 x 4 bytes a parameter): step 1 fits, the warning says step 2 may not, step 2
    fails with ENOSPC; step 1 still verifies."""
    from posttrain.models import build_tiny_model

    parameters = sum(p.numel() for p in build_tiny_model(seed=0)[0].parameters())
    mount, report = tmp_path / "small", tmp_path / "report.json"
    check = ("import json, sys; from pathlib import Path; from posttrain.runs.checkpoint import complete_checkpoints; "
             "d = Path(sys.argv[1]); json.dump({'names': sorted(p.name for p in d.iterdir()), "
             "'verified': [p.name for p in complete_checkpoints(d)]}, open(sys.argv[2], 'w'))")
    script = f'"$@"; code=$?; {sys.executable} -c "{check}" {mount}/run/checkpoints {report}; exit $code'
    result = on_small_filesystem(mount, int(1.5 * 12 * parameters), "sh", "-c", script, "sh",
                                 *SFT, "--max-steps", "2", "--checkpoint_every", "1", "--output-dir", str(mount / "run"))
    assert result.returncode == 74, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    where = re.escape(str(mount))
    assert re.fullmatch(rf"posttrain: error: cannot write {where}/run/checkpoints/\.tmp-step-000002-\d+(/trainer_state\.pt)?: "
                        rf"No space left on device \([\d.]+ (B|KiB|MiB) free on {where}\)", last), last
    assert "the next one may not fit" in result.stderr and "Traceback" not in result.stderr
    assert json.loads(report.read_text()) == {"names": ["step-000001"], "verified": ["step-000001"]}


def test_cli_a_write_no_writer_of_ours_caught_is_one_line_too(tmp_path):
    """`posttrain eval` writes eval.json with `Path.write_text`; past a 1 KiB file-size limit the
    OSError names no file, and the CLI finds it in the failed frame: one line, exit 74."""
    out = tmp_path / "eval"
    result = subprocess.run([sys.executable, "-m", "posttrain", "eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "4",
                             "--max-new-tokens", "8", "--output-dir", str(out)], capture_output=True, text=True, cwd=ROOT,
                            preexec_fn=file_size_limit(1024), timeout=300)
    assert result.returncode == 74, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"posttrain: error: cannot write {re.escape(str(out))}/eval\.json: File too large {FREE}", last), last
    assert "Traceback" not in result.stderr
