"""The prompt example and task types, and the rules that keep train and held-out splits apart."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.files import pick
from posttrain.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class Example:
    """One prompt plus what its verifier needs. Plain fields only, so it pickles and JSON-dumps.

    Exactly one of `prompt` / `messages` is set. `answer` is the gold answer (math, arithmetic,
    reasoning-gym), `tests` + `entry_point` are for code. reasoning-gym rows keep their dataset name,
    options and original entry in `metadata` (`rg_dataset`, `rg_options`, `entry`) for its scorer.
    """

    id: str
    prompt: str | None = None
    messages: list[dict] | None = None
    answer: str | None = None
    tests: list[str] | None = None
    entry_point: str | None = None
    metadata: dict = field(default_factory=dict)

    @property
    def prompt_input(self) -> str | list[dict]:
        """What `posttrain.data.render_prompt` takes: the messages if any, else the prompt string."""
        return self.messages if self.messages is not None else self.prompt

    def prompt_key(self) -> str:
        """The text two examples must share to be exact duplicates (whitespace at the ends ignored)."""
        if self.messages is not None:
            return "\n".join(f"{m['role']}: {m['content'].strip()}" for m in self.messages)
        return (self.prompt or "").strip()


@dataclass
class Task:
    """A list of examples from one source and split, and what loading them dropped."""

    name: str
    """The spec it came from: `arithmetic`, `rg:<name>`, `humaneval`, or a JSONL path."""
    split: str
    """`train`, `eval`, or `all` (an unsplit load)."""
    examples: list[Example]
    """A list, or for a data file a `data.files.RowView` (the same sequence, parsed on reading)."""
    reward_kind: str
    """A hint for the verifier: `number` (exact integer), `math` (math-verify), `reasoning_gym`
    (the dataset's own scorer), `code` (tests in the sandbox)."""
    rows_bad: int = 0
    """Rows dropped by validation with strict: false (0 when strict)."""
    duplicates_removed: int = 0
    """Training examples removed because their prompt is also in the held-out split."""
    options: dict = field(default_factory=dict)
    rows_bad_reasons: dict[str, int] = field(default_factory=dict)
    """The dropped rows per kind of problem (`ValidationReport.reasons`), for the run card."""

    def __len__(self) -> int:
        return len(self.examples)


def derived_seed(seed: int, *labels: str) -> int:
    """A stable 63-bit seed from a base seed and labels (e.g. the split name): different labels give
    unrelated streams, identical across runs and machines (unlike Python's salted `hash`)."""
    digest = hashlib.sha256(":".join([str(seed), *labels]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def remove_overlap(train: Task, held_out: Task) -> int:
    """Remove from `train`, in place, every example whose prompt exactly equals a held-out prompt.

    The held-out split stays as it is, so it depends only on its own seed and size. Returns the
    number removed (also added to `train.duplicates_removed`) and logs it when non-zero.
    """
    held_out_keys = {example.prompt_key() for example in held_out.examples}
    before = len(train.examples)
    train.examples = pick(train.examples, [i for i, e in enumerate(train.examples) if e.prompt_key() not in held_out_keys])
    removed = before - len(train.examples)
    train.duplicates_removed += removed
    if removed:
        logger.info("%s: removed %d training prompts that also appear in the held-out split", train.name, removed)
    return removed


def check_disjoint(train: Task, held_out: Task) -> None:
    """Raise ValueError if any prompt is in both splits (after `remove_overlap` none should be)."""
    shared = {e.prompt_key() for e in train.examples} & {e.prompt_key() for e in held_out.examples}
    if shared:
        raise ValueError(f"{len(shared)} prompts are in both the training and held-out splits of {train.name}")


def require_examples(task: Task, batch_size: int = 1, setting: str | None = None) -> None:
    """UserError unless `task` holds at least one batch: an empty or too small dataset must stop a
    run before its first step, never hang it or repeat its examples within a step. `setting` names
    the batch size's setting in the line (`data.prompts_per_step`)."""
    if not task.examples:
        raise UserError(f"{task.name} ({task.split}): no usable examples ({task.rows_bad} bad rows dropped)")
    if len(task.examples) < batch_size:
        raise UserError(
            f"{task.name} ({task.split}): {len(task.examples)} usable examples, fewer than one batch "
            + (f"of {setting}={batch_size} (a step would repeat them)" if setting else f"of {batch_size}")
        )


def verifier_input(example: Example, rendered_prompt: str | None = None) -> dict[str, Any]:
    """The plain mapping a verifier scores against (gold answer, tests, entry point, metadata), with
    the conversation (`messages`) of a chat prompt, whose `prompt` is None, and the prompt as the
    policy saw it (`rendered_prompt`, chat template applied) when given: what a reward model or a
    judge re-renders with its own template."""
    row: dict[str, Any] = {"id": example.id, "prompt": example.prompt, **example.metadata}
    if example.messages is not None:
        row["messages"] = [dict(message) for message in example.messages]
    if rendered_prompt is not None:
        row["rendered_prompt"] = rendered_prompt
    if example.answer is not None:
        row["answer"] = example.answer
    if example.tests is not None:
        row["tests"] = example.tests
        row["test"] = "\n".join(example.tests)
    if example.entry_point is not None:
        row["entry_point"] = example.entry_point
    return row
