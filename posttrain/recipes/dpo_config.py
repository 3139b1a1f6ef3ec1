"""The settings of `posttrain dpo`: the pairs (data: its section, `PairSource`, lives with the loader
in `posttrain/data/preference.py`), the objective (loss: its section lives with its step in
`posttrain/losses/preference.py`), held-out acceptance, checked in `validate` (called once, by
`build_config`). What the recipe does with them is `dpo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config import PolicyFields
from posttrain.data.files import resolve_columns
from posttrain.data.preference import PairSource
from posttrain.distributed import Parallel
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import check_set_specs
from posttrain.losses.preference import OBJECTIVES, Loss  # noqa: F401  (the loss section, re-exported with its card texts)
from posttrain.optim import Optimization


Data = PairSource
"""Link 1, data: the pairs (`data.*`); the section lives with the loader in `posttrain/data/preference.py`."""


@dataclass
class Acceptance:
    """Link 4, acceptance: held-out pairs, and held-out task accuracy with an independent checker."""

    task: str | None = None
    """Held-out task; None: the task recorded in the pairs' provenance (none: no task evaluation)."""
    task_options: dict | None = None
    """Task options (None: from the provenance)."""
    eval_size: int | None = None
    """Held-out task problems (None: the provenance's, so the split is the one the pairs avoided; else 200)."""
    split_seed: int | None = None
    """Seed of the task's train/held-out split (None: the provenance's, else `seed`)."""
    checker: str | None = None
    """Held-out checker (a verifier name); None: the task's strict default."""
    max_new_tokens: int = 32
    """Generation budget of the task evaluation."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the start and the end)."""
    displacement_threshold: float = 5.0
    """Likelihood-displacement alarm: mean chosen log-ratio below -threshold (nats) while accuracy rises."""
    alarm_window: int = 5
    """Steps averaged by the displacement alarm."""
    sets: list[dict] | None = None
    """Shifted held-out sets evaluated beside the held-out task, each {name, task, task_options, size, checker} (as grpo's acceptance.sets); None: the task's defaults (arithmetic: one more digit, the sums in words); []: none."""


@dataclass
class Config(PolicyFields):
    data: Data = field(default_factory=Data)
    """Link 1: the pairs."""
    loss: Loss = field(default_factory=Loss)
    """Link 3: the objective."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Link 4: held-out evaluation."""
    batch_size: int = 8
    """Pairs per optimizer step."""
    micro_batch_size: int = 8
    """Pairs per forward/backward (2x rows: chosen and rejected together); same gradient when smaller."""
    optim: Optimization = field(default_factory=lambda: Optimization(lr=5e-6))
    """Optimizer and schedule."""
    parallel: Parallel = field(default_factory=Parallel)
    """Under torchrun: DDP or FSDP2 (see posttrain/distributed.py); ignored in one process."""
    max_steps: int = 100

    def validate(self) -> None:
        super().validate()
        self.optim.validate()
        self.parallel.validate()
        if not self.data.pairs:
            raise UserError("data.pairs: give the preference JSONL to train on (--data.pairs FILE)")
        if self.data.format is not None or self.data.columns:
            resolve_columns(self.data.format, self.data.columns)
        self.loss.validate(self.lora_rank)
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.data.heldout_pairs < 0 or self.acceptance.alarm_window < 1 or self.acceptance.max_new_tokens < 1:
            raise UserError("data.heldout_pairs must be >= 0; acceptance.alarm_window and max_new_tokens >= 1")
        if self.acceptance.sets is not None:
            check_set_specs(self.acceptance.sets)
