"""`TaskSource`: where a run's prompts come from, the settings every data section shares. The online
recipe's `data` (grpo, ppo), SFT's and `posttrain pairs`' are each a `TaskSource` with their own
fields added (sizes per step, loss masks, how many prompts to pair); `posttrain eval` takes the same
settings as flat flags (--task, --task-options, --format, --columns, --split, --eval-size,
--system-prompt).

    source = TaskSource(task="gsm8k-train.parquet", format="gsm8k", eval_size=100)
    train, held_out = load_splits(source.task, eval_size=source.eval_size, seed=0, options=source.load_options())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.data.files import resolve_columns, task_load_options
from posttrain.errors import UserError


@dataclass
class TaskSource:
    """A task or a data file, how its columns map, and the held-out split kept apart."""

    PRIMARY: ClassVar[dict[str, Any]] = {"task": None}
    """What a value given to the section itself meant (`config._primary_hint`): `--data gsm8k.parquet` is --data.task gsm8k.parquet."""
    sizes: ClassVar[tuple[str, ...]] = ("eval_size",)
    """The fields that count examples: each must be at least 1 when set (a subclass names its own)."""

    task: str = "arithmetic"
    """Task spec: arithmetic | rg:<dataset> | humaneval | a data file (.jsonl, .parquet, .csv, .json, .arrow) | a save_to_disk directory | a cached owner/name."""
    task_options: dict = field(default_factory=dict)
    """Task options, e.g. {digits: 2} for arithmetic, a reasoning-gym dataset's config, {answer_format: gsm8k} for a file."""
    format: str | None = None
    """A data file's public layout: gsm8k | math | mmlu | mbpp | humaneval | code_contests | trl_prompt, and trl_sft for `posttrain sft` (its column mapping and gold format; docs/data.md)."""
    columns: dict = field(default_factory=dict)
    """Our column names -> the file's, e.g. {prompt: question, answer: answer} (overrides the format's)."""
    split: str | None = None
    """The split of a saved or cached dataset with several (default train)."""
    eval_size: int | None = None
    """Held-out problems, disjoint from training (checked) and never sampled for pairs; the split depends only on the task, its options, the seed and this size, so runs that share them evaluate on the same problems. None: 200 of a generated task or of a file of 2,000 rows or more, one row in 10 of a smaller file (logged; the run card records the size)."""
    system_prompt: str | None = None
    """Optional system prompt for chat models."""
    strict: bool = True
    """A data file's bad row stops the run, before anything is written (false: bad rows are dropped, logged and counted)."""

    def load_options(self) -> dict:
        """The options `load_splits` takes (`data.files.task_load_options`, and `strict: false`
        when set); `posttrain pairs` records them in its sidecar so that DPO rebuilds the same
        held-out split (dropping bad rows changes which rows are held out)."""
        options = task_load_options(self.task_options, self.format, self.columns, self.split)
        return options if self.strict else {**options, "strict": False}

    def validate(self, prefix: str = "data.") -> None:
        """Every field of `sizes` at least 1 (None: its default), and a known format and columns
        (`data.files.resolve_columns`); errors name a field as `<prefix><name>`."""
        for name in self.sizes:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{prefix}{name} must be at least 1, got {value}")
        if self.format is not None or self.columns:
            resolve_columns(self.format, self.columns)
