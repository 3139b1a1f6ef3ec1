"""The README's examples run as written: every `posttrain ...` line of its ```bash blocks, in order
(later commands use what earlier ones trained), and every ```python block, in a fresh directory
outside the checkout, as a user who installed posttrain runs them (presets by their names). Lines
starting with `make` are the set-up (CI runs those)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, flags=re.S)
COMMANDS = [
    line.strip()
    for language, body in BLOCKS
    if language == "bash"
    for line in body.splitlines()
    if line.strip().startswith(("posttrain ", "torchrun "))
]
PYTHON_BLOCKS = [body for language, body in BLOCKS if language == "python"]


def test_readme_opens_with_the_two_commands():
    first_block = BLOCKS[0][1]
    assert "make demo" in first_block and "make test" in first_block


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c[:60] for c in COMMANDS])
def test_readme_command_runs(index, workdir):
    command = COMMANDS[index]
    words = shlex.split(command.split(" #")[0])
    if words[0] == "torchrun":  # the launcher of this interpreter's torch
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    else:
        argv = [str(Path(sys.executable).parent / "posttrain"), *words[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if words[0] == "torchrun" else os.environ.copy()
    result = subprocess.run(argv, capture_output=True, text=True, cwd=workdir, timeout=900, env=env)
    assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs(index, workdir):
    result = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS[index]], capture_output=True, text=True, cwd=workdir, timeout=900
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_readme_has_examples():
    assert len(COMMANDS) >= 10 and len(PYTHON_BLOCKS) >= 2
