"""The settings of `posttrain dpo`: the pairs (data: its section, `PairSource`, lives with the loader
in `posttrain/data/preference.py`), the objective (loss: its section lives with its step in
`posttrain/losses/preference.py`), held-out acceptance, checked in `validate` (called once, by
`build_config`). What the recipe does with them is `dpo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.config import PolicyFields
from posttrain.data.preference import PairSource
from posttrain.distributed import Parallel
from posttrain.errors import UserError
from posttrain.evaluation import settings as evaluation_settings
from posttrain.losses.preference import Loss
from posttrain.optim import Optimization


Data = PairSource
"""Link 1, data: the pairs (`data.*`); the section lives with the loader in `posttrain/data/preference.py`."""


@dataclass
class Acceptance(evaluation_settings.Acceptance):
    """Link 4, acceptance (`evaluation/settings.Acceptance`: checker, max_new_tokens, eval_every,
    sets): held-out pairs, and held-out task accuracy with an independent checker on a task split
    taken from the pairs' provenance unless given here, watched by the likelihood-displacement alarm."""

    task: str | None = None
    """Held-out task; None: the task recorded in the pairs' provenance (none: no task evaluation)."""
    task_options: dict | None = None
    """Task options (None: from the provenance)."""
    eval_size: int | None = None
    """Held-out task problems (None: the provenance's, so the split is the one the pairs avoided; else 200)."""
    split_seed: int | None = None
    """Seed of the task's train/held-out split (None: the provenance's, else `seed`)."""
    displacement_threshold: float = 5.0
    """Likelihood-displacement alarm: mean chosen log-ratio below -threshold (nats) while accuracy rises."""
    alarm_window: int = 5
    """Steps averaged by the displacement alarm."""

    def validate(self, prefix: str = "acceptance.") -> None:
        super().validate(prefix)
        if self.alarm_window < 1:
            raise UserError(f"{prefix}alarm_window must be at least 1, got {self.alarm_window}")
        if self.eval_size is not None and self.eval_size < 1:
            raise UserError(f"{prefix}eval_size must be at least 1, got {self.eval_size}")


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
        self.data.validate()  # pairs given, format and columns known, heldout_pairs >= 0 (data/preference.PairSource)
        self.loss.validate(self.lora_rank)
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        self.acceptance.validate()
