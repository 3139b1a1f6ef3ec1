"""Recipe configs: a dataclass with a docstring under each field, YAML presets, command-line overrides.

Precedence: dataclass defaults < YAML file (`--config`) < command-line flags (`--key value`, dotted
keys for nested sections: `--sampling.temperature 0.7`). Unknown keys, wrong types and impossible
combinations raise `UserError` with one line naming the source (file or flag) and the key; a key a
config class declares moved (its `MOVED` table) is one line naming where it went, and a value given
to a section itself (`--tools '[add]'`, `--loss kto`) one line naming the key it meant, from the
section's `PRIMARY` table (`--tools.names '[add]'`, `--loss.type kto`). A list-of-strings field takes a
YAML list or a comma list (`--tools.names add,calculator`, as `--report_to wandb,mlflow`).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from posttrain.atomic import write_text_atomically
from posttrain.errors import UserError
from posttrain.hardware import Hardware, Memory
from posttrain.rewards.registry import RewardOptions


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` (PEP 257 attribute docstrings)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(annotation) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _coerce(value: Any, annotation, where: str) -> Any:
    """Check `value` against a field annotation; ints are accepted for floats."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        # The option of the value's own type first: `report_to: list[str] | str` keeps "none" a string.
        for option in sorted((a for a in args if a is not type(None)), key=lambda option: option is not type(value)):
            try:
                return _coerce(value, option, where)
            except UserError as error:
                errors.append(str(error))
        raise UserError(f"{where}: expected {_type_name(annotation)}, got {value!r}")
    if origin is Literal:
        if value is None and "none" in args:  # `--key none` on the command line reads as null
            value = "none"
        if value not in args:
            raise UserError(f"{where}: must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str) and args and args[0] is str:  # `--tools.names add,calculator`, as --report_to takes it
            value = [item.strip() for item in value.split(",") if item.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        return [_coerce(item, item_type, f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise UserError(f"{where}: expected a string, got {value!r}")
        return value
    raise UserError(f"{where}: unsupported field type {_type_name(annotation)}")


def moved_keys(cls, prefix: str = "") -> dict[str, str]:
    """The renamed keys of config class `cls`: its `MOVED` table and its bases' (old dotted key -> new
    dotted key, both from `cls`), prefixed with `prefix` (the section's own dotted name)."""
    moved: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        moved.update(vars(klass).get("MOVED", {}))
    return {f"{prefix}{old}": f"{prefix}{new}" for old, new in moved.items()}


def _check_moved(name: str, moved: dict[str, str], source: str) -> None:
    if name in moved:
        raise UserError(f"{source}: {name} moved to {moved[name]}")


def _check_moved_below(name: str, value: Any, moved: dict[str, str], source: str) -> None:
    """A mapping given to a plain key whose sub-key moved elsewhere: `reward: {overlong: ...}` (or
    `--reward.overlong.max_tokens 8`) is one line, `reward.overlong moved to reward_options.overlong`."""
    if isinstance(value, dict):
        for key in value:
            _check_moved(f"{name}.{key}", moved, source)


def _apply(config, values: dict[str, Any], source: str, prefix: str = "", moved: dict[str, str] | None = None) -> None:
    """Set fields of dataclass instance `config` from a (possibly nested) mapping, checking types.
    `moved`: the renamed keys declared above this section (dotted from the top)."""
    hints = typing.get_type_hints(type(config))
    fields = {f.name for f in dataclasses.fields(config)}
    moved = {**(moved or {}), **moved_keys(type(config), prefix)}
    for key, value in values.items():
        name = f"{prefix}{key}"
        _check_moved(name, moved, source)
        if key not in fields:
            known = ", ".join(sorted(fields))
            sections = [f"{prefix}{f.name}.{key}" for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))
                        and key in {g.name for g in dataclasses.fields(getattr(config, f.name))}]
            hint = f"; did you mean {sections[0]}?" if sections else ""
            raise UserError(f"{source}: unknown key '{name}' (known keys{' under ' + prefix.rstrip('.') if prefix else ''}: {known}){hint}")
        current = getattr(config, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(f"{source}: '{name}' is a section{_primary_hint(current, name, value, source) or '; give a mapping of its keys'}")
            if current.__dataclass_params__.frozen:  # an immutable settings type: a checked copy
                setattr(config, key, _replaced(current, value, source, f"{name}.", moved))
            else:
                _apply(current, value, source, f"{name}.", moved)
        else:
            _check_moved_below(name, value, moved, source)
            setattr(config, key, _coerce(value, hints[key], f"{source}: {name}"))


def _primary_hint(section, name: str, value: Any, source: str) -> str:
    """What a value given to section `name` itself meant, from the section's `PRIMARY` table (key ->
    the names it takes, or None: its Literal or its type says): `, not a value; did you mean
    --tools.names '[add]'?` for the first primary key that takes `value`, else the primary keys and
    the names each takes. A section without the table: ""."""
    primary = getattr(type(section), "PRIMARY", None)
    if not primary:
        return ""
    hints = typing.get_type_hints(type(section))

    def choices(key: str):
        names = primary[key]
        return list(names) if names is not None else list(typing.get_args(hints[key])) if typing.get_origin(hints[key]) is Literal else None

    def takes(key: str) -> bool:
        if choices(key) is not None:
            return isinstance(value, str) and value in choices(key)
        try:
            _coerce(value, hints[key], "")
        except UserError:
            return False
        return True

    def spelled(key: str, shown: str) -> str:
        return f"--{name}.{key} {shown}" if source == "command line" else f"{name}: {{{key}: {shown}}}"

    taking = [key for key in primary if takes(key)]
    if taking:
        shown = str(value).lower() if isinstance(value, bool) or value is None else str(value)
        if isinstance(value, (list, dict)):
            shown = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
            shown = f"'{shown}'" if source == "command line" else shown
        return f", not a value; did you mean {spelled(taking[0], shown)}?"
    return ", not a value; set its keys, e.g. " + " or ".join(
        spelled(key, "|".join(map(str, choices(key))) if choices(key) else "VALUE") for key in primary)


def _replaced(section, values: dict[str, Any], source: str, prefix: str, moved: dict[str, str]):
    """A copy of frozen dataclass `section` with `values` set, types checked; its own
    `__post_init__` checks the combination (its error gets the source's name)."""
    hints = typing.get_type_hints(type(section))
    fields = {f.name for f in dataclasses.fields(section)}
    moved = {**moved, **moved_keys(type(section), prefix)}
    changes = {}
    for key, value in values.items():
        _check_moved(f"{prefix}{key}", moved, source)
        if key not in fields:
            raise UserError(f"{source}: unknown key '{prefix}{key}' (known keys under {prefix.rstrip('.')}: {', '.join(sorted(fields))})")
        current = getattr(section, key)
        if dataclasses.is_dataclass(current):  # a section inside a frozen section (reward_options.overlong)
            if not isinstance(value, dict):
                raise UserError(f"{source}: '{prefix}{key}' is a section; give a mapping of its keys")
            changes[key] = _replaced(current, value, source, f"{prefix}{key}.", moved)
        else:
            changes[key] = _coerce(value, hints[key], f"{source}: {prefix}{key}")
    try:
        return dataclasses.replace(section, **changes)
    except UserError as error:
        raise UserError(f"{source}: {error}") from None


def _nest(dotted: dict[str, Any]) -> dict[str, Any]:
    """{"a.b": 1, "c": 2} -> {"a": {"b": 1}, "c": 2}; a key given a value and also used as a section
    (`--tools [add] --tools.describe none`) is one UserError line."""
    nested: dict[str, Any] = {}
    for key, value in dotted.items():
        node = nested
        *parents, leaf = key.split(".")
        for depth, parent in enumerate(parents):
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                section = ".".join(parents[:depth + 1])
                raise UserError(f"--{section} is given a value and --{key} uses it as a section; set the section's keys one by one")
        if isinstance(node.get(leaf), dict) and not isinstance(value, dict):
            raise UserError(f"--{key} is given a value and also used as a section (--{key}.…); set the section's keys one by one")
        node[leaf] = value
    return nested


def _scalar(text: str) -> Any:
    """A command-line value read as YAML (`3`, `0.5`, `true`, `[a, b]`, `null`), else the string."""
    if text.strip().lower() in ("null", "none", "~"):
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if value is None else value


def parse_overrides(arguments: list[str], once: bool = False) -> dict[str, Any]:
    """`['--lr', '1e-5', '--sampling.top_p=0.9']` -> `{'lr': 1e-05, 'sampling': {'top_p': 0.9}}`.

    Values are read as YAML scalars (numbers, true/false, null, [lists]); dashes in keys become
    underscores. A key given twice keeps its last value, unless `once` (what a user typed: the
    commands ask it), where it is a one-line UserError naming both (`--max-steps 2 and --max_steps 1`).
    """
    dotted: dict[str, Any] = {}
    given: dict[str, str] = {}  # key -> the flag and value that set it, for the message
    index = 0
    while index < len(arguments):
        flag = arguments[index]
        if not flag.startswith("--") or flag == "--":
            raise UserError(f"unexpected argument {flag!r}: config overrides are written --key value")
        key, separator, text = flag[2:].partition("=")
        if not separator:
            if index + 1 >= len(arguments) or arguments[index + 1].startswith("--"):
                raise UserError(f"--{key}: missing value")
            index += 1
            text = arguments[index]
        name = key.replace("-", "_")
        if once and name in given:
            raise UserError(f"{given[name]} and --{key} {text} set the same key; give it once")
        given[name] = f"--{key} {text}"
        dotted[name] = _scalar(text)
        index += 1
    return _nest(dotted)


def nest_flags(overrides: dict[str, Any], flags: dict[str, str]) -> dict[str, Any]:
    """`overrides` (nested, from `parse_overrides`) with each top-level short flag of `flags`
    moved to its dotted key: {"task": "x"} -> {"data": {"task": "x"}}. A key given both ways is one
    UserError line."""
    result = {key: value for key, value in overrides.items() if key not in flags}
    for short, dotted in flags.items():
        if short not in overrides:
            continue
        *parents, leaf = dotted.split(".")
        node = result
        for parent in parents:
            node = node.setdefault(parent, {})
        if leaf in node:
            raise UserError(f"--{short.replace('_', '-')} and --{dotted} set the same key; give one")
        node[leaf] = overrides[short]
    return result


PRESETS = Path(__file__).parent / "presets"
"""The presets shipped with posttrain (package data; the repository's presets/ directory), found by
name from anywhere: `--config tiny-grpo`."""


def preset_path(path: str | Path) -> Path:
    """The config file `path` names: the file itself, else a shipped preset named by its bare name
    (`tiny-grpo` or `tiny-grpo.yaml`); else a one-line UserError that says where the presets are."""
    path = Path(path)
    if path.is_file():
        return path
    shipped = PRESETS / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    names = sorted(preset.stem for preset in PRESETS.glob("*.yaml"))
    hint = f" (a preset shipped with posttrain is named by itself, e.g. --config {shipped.stem}: it is in {PRESETS})" \
        if shipped.is_file() else f"; the presets shipped with posttrain, by name: {', '.join(names)} (in {PRESETS})"
    raise UserError(f"{path}: config file not found{hint}")


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a missing file or bad YAML is a one-line `UserError`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{line}: invalid YAML ({getattr(error, 'problem', error)})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config file must be a mapping of keys to values")
    return data


def build_config(cls, yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None):
    """Defaults < YAML < overrides, type-checked, then `config.validate()` if the class has it: the
    one place a config is validated. `cls` is a config class or a function returning the defaults;
    `yaml_path` a file or a shipped preset's name (`preset_path`)."""
    config = cls()
    requires: list = []
    if yaml_path is not None:
        yaml_path = preset_path(yaml_path)
        values = load_yaml(yaml_path)
        requires = _requirements(values.pop("requires", []), yaml_path)
        _apply(config, values, str(yaml_path))
    if overrides:
        _apply(config, overrides, "command line")
    used = set(_strings(to_dict(config)))
    for path, command in requires:
        if path in used and not Path(path).exists():
            raise UserError(f"{yaml_path}: {path} does not exist yet; make it first with: {command}")
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def _requirements(entries: Any, yaml_path) -> list[tuple[str, str]]:
    """A preset's `requires:` list: the files an earlier run makes (`path`) and the command that
    makes each (`command`). Checked only for paths the final config still uses (an override of
    `model` to another directory lifts the requirement)."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) and set(e) == {"path", "command"} for e in entries):
        raise UserError(f"{yaml_path}: 'requires' must be a list of {{path: ..., command: ...}} entries")
    return [(str(e["path"]), str(e["command"])) for e in entries]


def _strings(value: Any):
    """Every string in a nested structure of dicts and lists."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def to_dict(config) -> dict[str, Any]:
    """The config as plain nested dicts (for config.yaml and the run card)."""
    return dataclasses.asdict(config)


def save_yaml(config, path: str | Path) -> None:
    write_text_atomically(path, yaml.safe_dump(to_dict(config), sort_keys=False))


def describe_fields(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field, nested sections flattened; for --help.
    `cls` is a config class or a function returning the defaults (an instance is described as is)."""
    rows = []
    instance = cls() if callable(cls) else cls
    docs = field_docs(type(instance))
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if dataclasses.is_dataclass(value):
            rows += describe_fields(value, f"{prefix}{field.name}.")
        else:
            rows.append((f"{prefix}{field.name}", repr(value), docs.get(field.name, "")))
    return rows


def tracker_names(report_to: list[str] | str | None) -> list[str]:
    """`report_to` as a list of names: a list as is; one name or a comma list as Hugging Face's
    `--report_to` takes it; none (or null) no tracker.

    >>> tracker_names("wandb"), tracker_names("wandb, mlflow"), tracker_names("none"), tracker_names(["tensorboard"])
    (['wandb'], ['wandb', 'mlflow'], [], ['tensorboard'])
    """
    if report_to is None:
        return []
    if isinstance(report_to, str):
        names = [name.strip() for name in report_to.split(",") if name.strip()]
        return [] if names == ["none"] else names
    return list(report_to)


@dataclasses.dataclass
class RunFields:
    """The fields every training recipe's config has, declared once (a recipe's config inherits
    them and may give `max_steps` or `checkpoint_every` another default). The command line gives
    `output_dir`, `max_steps` and `seed` flags of their own (`posttrain/commands/_recipe.py`)."""

    MOVED: ClassVar[dict[str, str]] = {}
    """Keys that moved (old dotted key -> new dotted key): a preset, a `--old.key` flag or a resumed
    run's config.yaml that still uses one is refused with one line, `eval_every moved to
    acceptance.eval_every`. A recipe's config (or any section) declares its own; they add up."""

    max_steps: int = 50
    """Training steps (optimizer steps for SFT and DPO; one batch of rollouts each for GRPO and PPO)."""
    checkpoint_every: int = 50
    """Save a checkpoint every N steps (and always at the end)."""
    seed: int = 0
    """Seeds data order, sampling and initialisation."""
    output_dir: str | None = None
    """Run directory (default runs/<recipe>-<time>)."""
    report_to: list[str] | str | None = dataclasses.field(default_factory=list)
    """Experiment trackers that also get the metrics, the config, the run card and the samples, offline, in the run directory: any of tensorboard, wandb, trackio, mlflow (`--report_to wandb`, `--report_to wandb,mlflow` or `--report_to '[wandb, mlflow]'`; none: no tracker; recorded as a list; each needs its package: `pip install 'posttrain[trackers]'`; docs/metrics.md, Trackers)."""
    tensorboard: bool = False
    """The same as tensorboard in report_to (kept for older configs): TensorBoard event files in <run>/tensorboard."""
    hardware: Hardware = dataclasses.field(default_factory=Hardware)
    """Device and precision (posttrain/hardware.py): --hardware.device cuda --hardware.precision bf16-mixed."""
    memory: Memory = dataclasses.field(default_factory=Memory)
    """Activation memory: --memory.gradient_checkpointing true."""
    reward_options: RewardOptions = dataclasses.field(default_factory=RewardOptions)
    """The settings of the verifiers the run builds by name (the training reward; the held-out checker, which never takes partial credit): timeout_s, memory_mb (code sandbox), partial_credit (code: passed / total), extraction."""
    unsafe_no_sandbox: bool = False
    """Run model-written code WITHOUT the bubblewrap sandbox (rlimits only). Never the default; the log and the run card say so loudly."""

    def validate(self) -> None:
        for name in ("max_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.report_to = tracker_names(self.report_to)  # resolved once, so config.yaml and the card hold the list
        from posttrain.runs.trackers import check_trackers  # here: the run packages (matplotlib...) only for a run

        check_trackers(self.trackers())

    def trackers(self) -> list[str]:
        """The trackers to report to: report_to, plus tensorboard under `tensorboard: true`, each once."""
        return list(dict.fromkeys(tracker_names(self.report_to) + (["tensorboard"] if self.tensorboard else [])))


@dataclasses.dataclass
class PolicyFields(RunFields):
    """The run fields plus the policy to train, declared once for the recipes that train with LoRA."""

    model: str = "tiny"
    """Model spec: tiny | smollm2-135m | a local Hugging Face directory | a hub id."""
    lora_rank: int = 0
    """LoRA rank (0: train all weights)."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
