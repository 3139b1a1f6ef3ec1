"""Which posttrain a GPU check ran, on a machine whose copy of the tree carries no .git.

    python3 bench/tree_hash.py --write .whl/STAMP --python 3.12   # here, by bench/gpu_wheels.sh
    python3 bench/tree_hash.py --describe .whl/STAMP              # there, by bench/gpu_check.sh

`--write` records the commit, whether the working tree had local changes, the Python the wheels are
for, and a SHA-256 of every tracked file as it is in the working tree. `--describe` prints one line:
the commit (from git when the tree has a .git, else from the stamp) and whether the files differ from
that commit, naming up to five that changed since the stamp was written. `--short` prints the short
form that goes into RESULT lines: `abc1234`, or `abc1234+local` when the code differs from the commit.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git(*arguments: str) -> str | None:
    """git's output in ROOT, or None where there is no git or no repository."""
    try:
        result = subprocess.run(["git", *arguments], capture_output=True, text=True, cwd=ROOT, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def file_hash(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def write(stamp: Path, python: str) -> None:
    commit = git("rev-parse", "HEAD")
    if commit is None:
        sys.exit("bench/tree_hash.py --write: not a git checkout")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    files = {name: file_hash(ROOT / name) for name in (git("ls-files") or "").splitlines()}
    record = {"commit": commit, "local_changes": dirty, "python": python,
              "written": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "files": {name: digest for name, digest in files.items() if digest is not None}}
    stamp.write_text(json.dumps(record, indent=0, sort_keys=True))
    print(f"{stamp}: posttrain at {commit[:7]}{' with local changes' if dirty else ''}, {len(record['files'])} files hashed")


def identity(stamp: Path) -> tuple[str, str]:
    """(short, sentence): `abc1234` or `abc1234+local`, and what was found."""
    commit = git("rev-parse", "HEAD")
    if commit is not None:
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return (commit[:7] + ("+local" if dirty else ""),
                f"posttrain at {commit[:7]}" + (" with local changes (git status)" if dirty else " (git)"))
    try:
        record = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return "?", f"posttrain at ? (no .git here and no readable {stamp}: run make gpu-wheels and carry .whl)"
    changed = [name for name, digest in record["files"].items() if file_hash(ROOT / name) != digest]
    short = record["commit"][:7] + ("+local" if record["local_changes"] or changed else "")
    sentence = f"posttrain at {record['commit'][:7]} (from {stamp}, written {record['written']}"
    sentence += ", with local changes then" if record["local_changes"] else ""
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        sentence += f"; {len(changed)} files changed since: {shown})"
    else:
        sentence += "; every tracked file as it was then)"
    return short, sentence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stamp", nargs="?", default=str(ROOT / ".whl" / "STAMP"))
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--describe", action="store_true")
    mode.add_argument("--short", action="store_true")
    parser.add_argument("--python", default="3.12", help="with --write: the Python version the wheels are for")
    arguments = parser.parse_args()
    stamp = Path(arguments.stamp)
    if arguments.write:
        write(stamp, arguments.python)
        return
    short, sentence = identity(stamp)
    print(short if arguments.short else sentence)


if __name__ == "__main__":
    main()
