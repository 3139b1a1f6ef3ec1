"""Config: defaults < YAML < command line; one-line errors for unknown keys and wrong types."""

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from posttrain.config import build_config, describe_fields, field_docs, parse_overrides
from posttrain.errors import UserError


@dataclasses.dataclass
class Sampling:
    temperature: float = 1.0
    """Softmax temperature."""
    top_p: float = 1.0
    """Nucleus mass."""


@dataclasses.dataclass
class Example:
    model: str = "tiny"
    """Model spec."""
    lr: float = 1e-4
    """Learning rate."""
    group_size: int = 4
    """G: samples per prompt."""
    scale: Literal["group", "batch", "none"] = "group"
    """Advantage scaling."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Stop strings."""
    eval_every: int | None = None
    """Evaluate every N steps (None: only at the end)."""
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    """Sampling settings."""

    def validate(self):
        if self.group_size < 2:
            raise UserError(f"group_size must be at least 2, got {self.group_size}")


def test_precedence_and_types(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("lr: 1e-5\ngroup_size: 8\nsampling:\n  temperature: 0.7\n")
    config = build_config(Example, preset, parse_overrides(["--group-size", "16", "--sampling.top_p=0.9", "--stop", "[a, b]"]))
    assert config.lr == 1e-5 and isinstance(config.lr, float)
    assert config.group_size == 16
    assert config.sampling.temperature == 0.7 and config.sampling.top_p == 0.9
    assert config.stop == ["a", "b"]
    assert build_config(Example, None, parse_overrides(["--eval-every", "null"])).eval_every is None
    assert build_config(Example, None, parse_overrides(["--eval-every", "5"])).eval_every == 5


@pytest.mark.parametrize(
    "yaml_text, overrides, message",
    [
        ("lrr: 1\n", [], "preset.yaml: unknown key 'lrr'"),
        ("", ["--sampling.tempreature", "1"], "unknown key 'sampling.tempreature'"),
        ("temperature: 0.5\n", [], "preset.yaml: unknown key 'temperature' (known keys: eval_every, group_size, lr, model, "
                                   "sampling, scale, stop); did you mean sampling.temperature?"),
        ("group_size: 2.5\n", [], "group_size: expected an integer, got 2.5"),
        ("", ["--scale", "rank"], "scale: must be one of 'group', 'batch', 'none'"),
        ("", ["--lr", "fast"], "lr: expected a number"),
        ("sampling: 3\n", [], "'sampling' is a section"),
        ("", ["--group-size", "1"], "group_size must be at least 2"),
        ("- a\n- b\n", [], "must be a mapping"),
        ("lr: [1\n", [], "invalid YAML"),
        ("", ["--lr"], "--lr: missing value"),
        ("", ["lr", "3"], "unexpected argument 'lr'"),
    ],
)
def test_errors_name_the_source_and_key(tmp_path, yaml_text, overrides, message):
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml_text)
    with pytest.raises(UserError) as error:
        build_config(Example, preset, parse_overrides(overrides))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_file():
    with pytest.raises(UserError, match="nope.yaml: config file not found"):
        build_config(Example, "nope.yaml")


def test_field_docs_and_help_rows():
    assert field_docs(Example)["lr"] == "Learning rate."
    rows = {key: (default, doc) for key, default, doc in describe_fields(Example)}
    assert rows["sampling.temperature"] == ("1.0", "Softmax temperature.")
    assert rows["group_size"] == ("4", "G: samples per prompt.")


def test_a_preset_names_the_command_that_makes_what_it_requires(tmp_path, monkeypatch):
    """`requires:` entries are checked against the final config: a missing path still in use is one
    line naming the command to run first; an override that no longer uses it lifts the requirement.
    Run from an empty directory: a checkout that made the SFT start (runs/ is where it goes) still
    tests the missing case."""
    from posttrain.recipes import online_config

    monkeypatch.chdir(tmp_path)

    preset = Path(__file__).resolve().parent.parent / "presets" / "tiny-grpo.yaml"
    with pytest.raises(UserError, match=r"runs/tiny-sft-start/checkpoints/step-000400/model does not exist yet; make it first with: "
                                        r"posttrain sft --config tiny-sft --max-steps 400 --output-dir runs/tiny-sft-start"):
        build_config(online_config.grpo_config, preset, {"output_dir": str(tmp_path / "run")})
    assert build_config(online_config.grpo_config, preset, {"model": "tiny"}).model == "tiny"
    bad = tmp_path / "bad.yaml"
    bad.write_text("requires: [runs/x]\n")
    with pytest.raises(UserError, match="'requires' must be a list of"):
        build_config(online_config.grpo_config, bad)


@dataclasses.dataclass(frozen=True)
class Frozen:
    MOVED = {"top": "top_p"}  # a section's own table: keys relative to the section
    top_p: float = 1.0


@dataclasses.dataclass
class Renamed:
    MOVED = {"eval_every": "acceptance.eval_every", "sampling.temp": "sampling.temperature"}  # dotted from the top
    acceptance: Example = dataclasses.field(default_factory=Example)
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    frozen: Frozen = dataclasses.field(default_factory=Frozen)


@pytest.mark.parametrize("yaml_text, overrides, message", [
    ("eval_every: 3\n", [], "preset.yaml: eval_every moved to acceptance.eval_every"),
    ("", ["--eval_every", "3"], "command line: eval_every moved to acceptance.eval_every"),
    ("", ["--eval-every", "3"], "command line: eval_every moved to acceptance.eval_every"),
    ("sampling: {temp: 0.5}\n", [], "preset.yaml: sampling.temp moved to sampling.temperature"),
    ("", ["--sampling.temp", "0.5"], "command line: sampling.temp moved to sampling.temperature"),
    ("", ["--frozen.top", "0.5"], "command line: frozen.top moved to frozen.top_p"),
])
def test_a_moved_key_is_one_line_naming_the_new_key(tmp_path, yaml_text, overrides, message):
    """A renamed key in a preset, a flag or a nested section: one line saying where it went, checked
    before the unknown-key error (which would only guess); the new key works."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml_text)
    with pytest.raises(UserError) as error:
        build_config(Renamed, preset, parse_overrides(overrides))
    assert str(error.value) == (f"{tmp_path}/{message}" if message.startswith("preset.yaml") else message)
    config = build_config(Renamed, None, parse_overrides(["--acceptance.eval_every", "3", "--sampling.temperature", "0.5",
                                                          "--frozen.top_p", "0.5"]))
    assert (config.acceptance.eval_every, config.sampling.temperature, config.frozen.top_p) == (3, 0.5, 0.5)


def test_sft_acceptance_keys_moved_into_their_section():
    """sft's eval_every, max_new_tokens, checker and sets are acceptance.*: each old key is one line,
    each new key is a field of the config."""
    from posttrain.recipes import sft

    fields = {key for key, _, _ in describe_fields(sft.Config)}
    for old in ("eval_every", "max_new_tokens", "checker", "sets"):
        assert sft.Config.MOVED[old] == f"acceptance.{old}" and f"acceptance.{old}" in fields and old not in fields
        with pytest.raises(UserError, match=rf"^command line: {old} moved to acceptance\.{old}$"):
            build_config(sft.Config, None, {old: None})
    config = build_config(sft.Config, None, parse_overrides(["--acceptance.eval_every", "3", "--acceptance.max_new_tokens", "6"]))
    assert (config.acceptance.eval_every, config.acceptance.max_new_tokens) == (3, 6)
    with pytest.raises(UserError, match=r"^acceptance\.max_new_tokens must be at least 1, got 0$"):
        build_config(sft.Config, None, {"acceptance": {"max_new_tokens": 0}})


def test_sft_cli_preset_and_resume_with_an_old_key_are_one_line_and_write_nothing(tmp_path, capsys):
    """`posttrain sft` with an old key in a preset, as a flag, or in the config.yaml of a run it
    resumes: exit 2, one stderr line, no traceback, nothing written."""
    from posttrain.cli import main

    preset = tmp_path / "old.yaml"
    preset.write_text("model: tiny\neval_every: 100\n")
    out = tmp_path / "run"
    for arguments, line in [(["--config", str(preset)], f"posttrain: error: {preset}: eval_every moved to acceptance.eval_every"),
                            (["--max_new_tokens", "6"], "posttrain: error: command line: max_new_tokens moved to acceptance.max_new_tokens")]:
        assert main(["sft", *arguments, "--output-dir", str(out)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
        assert not out.exists()
    old_run = tmp_path / "old-run"
    old_run.mkdir()
    (old_run / "config.yaml").write_text("model: tiny\nmax_steps: 2\neval_every: 0\nmax_new_tokens: 24\n")
    before = sorted(old_run.iterdir())
    assert main(["sft", "--resume", str(old_run)]) == 2
    # The resumed run's own config.yaml is named as the source of the old key.
    assert capsys.readouterr().err.strip().splitlines() == [f"posttrain: error: {old_run / 'config.yaml'}: eval_every moved to acceptance.eval_every"]
    assert sorted(old_run.iterdir()) == before and "eval_every: 0" in (old_run / "config.yaml").read_text()


def test_every_shipped_preset_builds_its_recipes_config(tmp_path):
    """Each preset's keys are real settings of its recipe and pass validation (its `requires:` paths
    aside, lifted by pointing the start at the tiny model and, for pairs, at a file of one pair)."""
    import json

    from posttrain.config import PRESETS
    from posttrain.recipes import dpo_config, iterative_dpo, online_config, rm, sft

    online = {name: online_config.grpo_config for name in ("grpo", "rloo", "reinforce", "gspo", "cispo", "distill")}
    offline = {name: dpo_config.Config for name in ("dpo", "orpo", "kto", "simpo", "cpo")}
    recipes = {"sft": sft.Config, **online, "ppo": online_config.ppo_config, **offline, "iterative": iterative_dpo.Config, "rm": rm.Config}
    names = sorted(path.stem for path in PRESETS.glob("*.yaml"))
    assert {name.split("-")[1] for name in names} <= set(recipes), names
    pairs = tmp_path / "one_pair.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    for name in names:
        kind = name.split("-")[1]
        overrides = {"model": "tiny", **({"data": {"pairs": str(pairs)}} if kind in (*offline, "rm") else {})}
        config = build_config(recipes[kind], PRESETS / f"{name}.yaml", overrides)
        if kind == "rloo":
            assert config.loss.advantage == "rloo" and config.loss.kl.placement == "reward"
        if kind == "orpo":
            assert config.loss.type == "orpo" and config.loss.nll_weight == 1.0
