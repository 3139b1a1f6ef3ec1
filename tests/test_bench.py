"""Smoke runs of the benchmark scripts on the tiny model: they mirror the recipes' loops, so an API
change that breaks them fails here, not on the next benchmark day. Numbers are not checked (timing
is never asserted); the output's last line must be the RESULT line `make bench` reads."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULT = re.compile(r"^RESULT (\w+): ours=[\d.]+ peer=[\d.]+ unit=\S+ ratio=[\d.]+$")


def bench(name: str, *arguments: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *arguments], capture_output=True,
                            text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("name, arguments", [
    ("rollout", ["--model", "tiny", "--rounds", "1", "--new-tokens", "4"]),
    ("grpo", ["--model", "tiny", "--steps", "1", "--warmup", "0"]),
    ("verify_humaneval", ["--repeats", "1", "--workers", "1"]),
    pytest.param("dpo", ["--model", "tiny", "--steps", "1", "--warmup", "1"], marks=pytest.mark.slow),
    pytest.param("distributed", ["--steps", "3", "--warmup", "1", "--rounds", "1"], marks=pytest.mark.slow),
])
def test_bench_script_ends_with_its_result_line(name, arguments):
    last = bench(name, *arguments).strip().splitlines()[-1]
    match = RESULT.match(last)
    assert match and match.group(1) == name, last


@pytest.mark.parametrize("side", ["ours", "ours-precomputed"])
def test_dpo_bench_runs_our_side(side):
    """Our side of bench/dpo.py (the library's loss step, `losses.preference.step`) in the default suite; the whole script,
    TRL's sides included, is the slow case above."""
    result = json.loads(bench("dpo", "--side", side, "--model", "tiny", "--steps", "1", "--warmup", "1").strip().splitlines()[-1])
    assert result["steps_per_second"] > 0 and result["peak_rss_mb"] > 0


def test_gpu_bench_on_the_cpu_ends_with_result_lines_naming_the_commit():
    """bench/gpu.py's own test (tiny shapes on the CPU, the generation lines only): generation comes
    first, then the early-stop line; every RESULT line names the code it ran."""
    lines = bench("gpu", "--device", "cpu", "--small", "--only", "generate", "--rounds", "1").strip().splitlines()
    results = [line for line in lines if line.startswith("RESULT ")]
    assert [line.split(":")[0] for line in results] == ["RESULT gpu_generate", "RESULT gpu_generate_stops"]
    for line in results:
        assert re.match(r"^RESULT \w+: ours=[\d.]+ peer=[\d.]+ unit=tokens/s ratio=[\d.]+ commit=[0-9a-f]{7}(\+local)?$", line), line
    assert "posttrain at " in lines[0]


def test_tree_hash_names_the_commit_and_the_files_changed_since(tmp_path, monkeypatch):
    """Where the copy has no .git (the GPU machine), the stamp written at `make gpu-wheels` says
    which commit the files are and which changed since."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import tree_hash
    finally:
        sys.path.remove(str(ROOT / "bench"))
    stamp = tmp_path / "STAMP"
    monkeypatch.setattr(tree_hash, "ROOT", ROOT)
    tree_hash.write(stamp, "3.12")
    record = json.loads(stamp.read_text())
    assert record["python"] == "3.12" and "posttrain/distributed.py" in record["files"]
    copy = tmp_path / "copy"  # the files of two tracked paths, outside any git repository
    for name in ("Makefile", "posttrain/distributed.py"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes((ROOT / name).read_bytes())
    record["files"] = {name: record["files"][name] for name in ("Makefile", "posttrain/distributed.py")}
    record["local_changes"] = False
    stamp.write_text(json.dumps(record))
    monkeypatch.setattr(tree_hash, "ROOT", copy)
    short, sentence = tree_hash.identity(stamp)
    assert short == record["commit"][:7] and "every tracked file as it was then" in sentence
    (copy / "Makefile").write_text("changed\n")
    short, sentence = tree_hash.identity(stamp)
    assert short == record["commit"][:7] + "+local" and "1 files changed since: Makefile" in sentence
    assert tree_hash.identity(tmp_path / "absent")[0] == "?"


def test_gpu_check_rehearsed_without_a_gpu(tmp_path):
    """`bash bench/gpu_check.sh` where there is no GPU: every stage runs or says why not in one line
    (the CUDA stages: "no GPU"), and the summary names the code and the machine's versions."""
    environment = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable, "WHEEL_DIR": str(tmp_path / "no-wheels"),
                   "GPU_CHECK_SITE": str(tmp_path / "site")}
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True, cwd=ROOT,
                            env=environment, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = (tmp_path / "gpu_results.md").read_text()
    stages = dict(re.findall(r"^\| (\w+) \| \S+ \| \d+ \| ([^|]+) \|$", summary, flags=re.M))
    assert stages["environment"].strip() == "ok" and stages["versions"].strip() == "ok"
    assert stages["install"].strip() == "FAILED"  # no wheels here: said so in one line
    assert "no wheels in" in (tmp_path / "gpu_install.log").read_text()
    if not __import__("torch").cuda.is_available():
        assert stages["tests"].strip() == "no GPU" and stages["bench"].strip() == "no GPU"
    assert "posttrain at " in summary.splitlines()[0] and "pyarrow" in summary and "pip check" in summary
