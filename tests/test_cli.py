"""`posttrain` itself: the recipe commands come from one table, their --help lists the config fields,
and only the command that runs (or shows its --help) imports its heavy modules."""

import subprocess
import sys

import pytest

from posttrain.cli import build_parser, main
from posttrain.commands._recipe import RECIPES, settings_factory
from posttrain.config import describe_fields

WITHOUT_TORCH = (["--help"], ["verify", "--help"], ["data", "check", "--help"])
"""Commands whose --help never imports torch. `eval --help`, like a recipe's, lists its config
fields, and its sections (`data.source.TaskSource`) import the data package, which imports torch."""


@pytest.mark.parametrize("argv", WITHOUT_TORCH, ids=" ".join)
def test_help_does_not_import_torch(argv):
    """A fresh interpreter: the parser of every command is built, and torch is never imported."""
    script = ("import sys\nfrom posttrain.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"


def test_commands_are_listed_in_name_order():
    """The recipes of the table and the discovered command modules, alphabetically in `posttrain --help`."""
    subparsers = next(action for action in build_parser()._actions if action.dest == "command")
    names = list(subparsers.choices)
    assert names == sorted(names)
    assert {recipe.command for recipe in RECIPES} | {"eval", "explain", "pairs", "verify"} <= set(names)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda recipe: recipe.command)
def test_recipe_help_lists_every_config_field(recipe, capsys):
    with pytest.raises(SystemExit) as stop:
        main([recipe.command, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert recipe.help in out and "--resume DIR" in out and "config fields (as --key value, or in the YAML file):" in out
    for key, default, _ in describe_fields(settings_factory(recipe.module, recipe.settings)):
        assert f"  {key} " in out and f"[default {default}]" in out


def test_explain_examples_are_added_when_parsed(capsys):
    """explain's examples are its parser's deferred part: they still parse and reject as before."""
    assert main(["explain", "advantages", "--rewards", "1", "0", "--json"]) == 0
    assert '"advantages": [1.0, -1.0]' in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["explain", "dpo", "--chosen", "1", "--rejected", "1", "--ref-chosen", "1", "--ref-rejected", "1", "--loss", "x"])
    assert stop.value.code == 2 and "argument --loss: invalid choice: 'x'" in capsys.readouterr().err
