"""The layout's two promises that docs/architecture.md relies on instead of a hand-kept file list:
every module of the package says what it holds in its own docstring, and every module path a page
in docs/ or the README names exists (a move or a split that forgets a page fails here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "posttrain"
FOLDERS = "algorithms|models|data|rollout|rewards|evaluation|runs|losses|recipes|commands"
MODULE_PATH = re.compile(rf"(?<![\w/.])((?:posttrain/)?(?:{FOLDERS})/[a-z_0-9]+\.py)")


def test_every_module_says_what_it_holds():
    """A docstring of at least one sentence (a package's `__init__` too: `help(posttrain.losses)` is
    where the picture of a folder starts)."""
    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = ast.get_docstring(ast.parse(path.read_text()))
        if not text or len(text.split()) < 5:
            silent.append(str(path.relative_to(ROOT)))
    assert not silent, f"modules without a docstring that says what they hold: {silent}"


def test_every_module_path_the_docs_name_exists():
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    missing = []
    for page in pages:
        for match in MODULE_PATH.finditer(page.read_text()):
            name = match.group(1)
            path = ROOT / (name if name.startswith("posttrain/") else f"posttrain/{name}")
            if not path.exists():
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert pages and not missing, f"pages name modules that do not exist: {missing}"


def test_the_path_pattern_finds_what_the_pages_write():
    """The pattern itself: a path with or without `posttrain/`, not a URL's or another folder's."""
    found = [m.group(1) for m in MODULE_PATH.finditer(
        "see `losses/sft.py`, posttrain/runs/timer.py, https://x.org/data/y.py and bench/data/z.py")]
    assert found == ["losses/sft.py", "posttrain/runs/timer.py"]
