"""The README's examples run as written: every `posttrain ...` line of its ```bash blocks and every
```python block. Lines starting with `make` are the set-up commands (exercised by CI itself)."""

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
    if line.strip().startswith("posttrain ")
]
PYTHON_BLOCKS = [body for language, body in BLOCKS if language == "python"]


def test_readme_opens_with_the_two_commands():
    first_block = BLOCKS[0][1]
    assert "make demo" in first_block and "make test" in first_block


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_runs(command):
    executable = Path(sys.executable).parent / "posttrain"
    argv = [str(executable), *shlex.split(command.split("#")[0])[1:]]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600, env=os.environ.copy())
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", PYTHON_BLOCKS[index]], capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    assert result.returncode == 0, result.stderr


def test_readme_has_examples():
    assert len(COMMANDS) >= 4 and PYTHON_BLOCKS
