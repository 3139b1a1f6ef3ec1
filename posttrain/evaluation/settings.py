"""The acceptance link's settings, declared once. `Checking`: how held-out problems are scored (the
checker and the generation budget), what every evaluation shares; `Acceptance`: a training run's
section, which adds the cadence and the shifted held-out sets. Each recipe's config subclasses
`Acceptance` with its own alarm settings or defaults (`recipes/online_config.py`,
`recipes/dpo_config.py`, `recipes/sft.py`). `EvalConfig` is `posttrain eval`'s settings: the same
data section (`data/source.TaskSource`), `Checking` with pass@k, the hardware and the verifier
settings, so that a flag means what the same key means in a recipe.

    posttrain eval --model runs/grpo-x/checkpoints/step-000050/model --data.task arithmetic --output-dir runs/eval-x
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.data.source import TaskSource
from posttrain.errors import UserError
from posttrain.hardware import Hardware
from posttrain.rewards.registry import RewardOptions
from posttrain.rollout.engines import RolloutSettings
from posttrain.rollout.episodes import ToolSettings
from posttrain.rollout.sampling import SamplingConfig


@dataclass
class Checking:
    """How held-out problems are scored: generated within a budget, judged by a checker chosen
    apart from any training reward."""

    checker: str | None = None
    """Held-out checker (a verifier name); None: the task's strict default (written apart from any reward)."""
    max_new_tokens: int = 32
    """Generation budget of each held-out answer."""

    def validate(self, prefix: str = "acceptance.") -> None:
        """One UserError line naming `<prefix><field>` for a budget below 1."""
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise UserError(f"{prefix}max_new_tokens must be at least 1, got {self.max_new_tokens}")


@dataclass
class Acceptance(Checking):
    """Link 4, acceptance: held-out problems scored by a checker chosen apart from the reward, how
    often, and the shifted held-out sets beside the in-distribution split."""

    eval_every: int = 0
    """Evaluate every N steps (0: only at the start and the end)."""
    sets: list[dict] | None = None
    """Shifted held-out sets evaluated beside the in-distribution split, each {name, task, task_options, size, checker} (task defaults to data.task, size to min(eval_size, 200)); None: the task's defaults (arithmetic: one more digit, and the sums in words; reasoning-gym: harder); []: none."""

    def validate(self, prefix: str = "acceptance.") -> None:
        """`Checking.validate`, a cadence of at least 0 and well-formed `sets` (`check_set_specs`)."""
        super().validate(prefix)
        if self.eval_every < 0:
            raise UserError(f"{prefix}eval_every must be at least 0, got {self.eval_every}")
        if self.sets is not None:
            if not isinstance(self.sets, list):
                raise UserError(f"{prefix}sets must be a list of held-out sets, got {self.sets!r}")
            from posttrain.evaluation.acceptance import check_set_specs  # here: it imports torch

            check_set_specs(self.sets, f"{prefix}sets")


@dataclass
class EvalChecking(Checking):
    """`posttrain eval`'s scoring: greedy pass@1, and pass@k from k samples at a temperature."""

    max_new_tokens: int = 64
    """Generation budget of each held-out answer (64: a short answer of a real model)."""
    k: int = 1
    """Also report pass@k from k samples per problem (1: greedy pass@1 only)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples."""

    def validate(self, prefix: str = "acceptance.") -> None:
        super().validate(prefix)
        if self.k < 1:
            raise UserError(f"{prefix}k must be at least 1, got {self.k}")
        if self.temperature <= 0:
            raise UserError(f"{prefix}temperature must be > 0, got {self.temperature}")


@dataclass
class EvalConfig:
    """`posttrain eval`: one model's held-out acceptance on the split a training run with the same
    data.task, task_options, seed and eval_size kept apart (it depends on nothing else)."""

    FLAGS: ClassVar[dict[str, str]] = {
        "task": "data.task", "task_options": "data.task_options", "format": "data.format", "columns": "data.columns",
        "split": "data.split", "eval_size": "data.eval_size", "system_prompt": "data.system_prompt",
        "checker": "acceptance.checker", "k": "acceptance.k", "temperature": "acceptance.temperature",
        "max_new_tokens": "acceptance.max_new_tokens", "timeout": "reward_options.timeout_s",
        "memory_mb": "reward_options.memory_mb", "extraction": "reward_options.extraction",
    }
    """The short flags (`--task`, `--k`, `--timeout` ...) and the key each one sets."""

    model: str = ""
    """The model to evaluate: a model spec (tiny, smollm2-135m) or a checkpoint's model directory."""
    output_dir: str = ""
    """Where eval.json (every row) and summary.json go; must be new or empty."""
    seed: int = 0
    """The training run's seed: it chose the held-out split, and seeds the pass@k samples."""
    data: TaskSource = field(default_factory=TaskSource)
    """Which held-out problems: the task, its options, format, columns, split, eval_size, system_prompt."""
    acceptance: EvalChecking = field(default_factory=EvalChecking)
    """How they are scored: checker, generation budget, pass@k."""
    reward_options: RewardOptions = field(default_factory=RewardOptions)
    """The checker's settings: timeout_s and memory_mb (code sandbox), extraction."""
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    """The engine that samples the answers (`rollout/engines.py`): builtin, or vllm (--rollout.engine vllm)."""
    tools: ToolSettings = field(default_factory=ToolSettings)
    """Held-out answers as tool episodes (`--tools.names [add]`, `--tools.max_turns 3`): the checker reads the last assistant turn; eval.json keeps each transcript."""
    unsafe_no_sandbox: bool = False
    """Run model-written code WITHOUT the bubblewrap sandbox (rlimits only). Never the default; the output and the summary say so."""
    hardware: Hardware = field(default_factory=Hardware)
    """Device and precision, as in the recipes."""

    def validate(self) -> None:
        if not self.model:
            raise UserError("model: give the model or checkpoint to evaluate (--model DIR)")
        if not self.output_dir:
            raise UserError("output_dir: give the directory the results go to (--output-dir DIR)")
        self.data.validate()
        self.acceptance.validate()
        self.tools.validate()
        self.rollout.validate(SamplingConfig(temperature=self.acceptance.temperature) if self.acceptance.k > 1 else None)

