"""The settings of `posttrain dpo`: the pairs (data), the objective (loss), held-out acceptance,
checked in `validate` (called once, by `build_config`). What the recipe does with them is `dpo.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from posttrain.algorithms import LABEL_SMOOTHED
from posttrain.config import PolicyFields
from posttrain.data import TruncationPolicy
from posttrain.data.files import resolve_columns
from posttrain.distributed import Parallel
from posttrain.errors import UserError
from posttrain.evaluation.acceptance import check_set_specs
from posttrain.optim import Optimization

OBJECTIVES = {
    "sigmoid": "DPO sigmoid loss (arXiv:2305.18290 eq. 7)",
    "conservative": "conservative DPO, label smoothing (Mitchell 2023)",
    "robust": "robust DPO, unbiased under label noise (arXiv:2403.00409 eq. 8)",
    "ipo": "IPO squared loss (arXiv:2310.12036 eq. 17) on summed log-ratios",
    "hinge": "hinge / SLiC (arXiv:2305.10425 eq. 3)",
    "length_normalized": "length-normalised DPO: sigmoid loss on per-token MEAN log-probs (a different objective)",
    "length_normalized_ipo": "length-normalised IPO (TRL's ipo): IPO squared loss on per-token MEAN log-ratios (a different objective)",
}
"""What the run card says each `loss.type` is."""


@dataclass
class Data:
    """Link 1, data: the pairs, the held-out pairs, and how over-long rows are handled."""

    pairs: str = ""
    """Preference pairs to train on (TRL standard or conversational format): a .jsonl, .parquet, .csv,
    .json or .arrow file, a `save_to_disk` directory, or a dataset name in the local Hugging Face cache."""
    heldout_file: str | None = None
    """Held-out pairs, read like `pairs` (the same format, columns and split); None: split
    `heldout_pairs` off `pairs` (by prompt, seeded)."""
    heldout_pairs: int = 32
    """Pairs split off `pairs` for held-out preference accuracy when no heldout_file (0: none)."""
    format: str | None = None
    """The pairs' public layout: trl_preference (prompt, chosen, rejected; docs/data.md)."""
    columns: dict = field(default_factory=dict)
    """Our column names -> the file's, e.g. {chosen: better, rejected: worse} (overrides the format's)."""
    split: str | None = None
    """The split of a saved or cached dataset with several (default train)."""
    strict: bool = True
    """A bad row stops the run (false: bad rows are dropped and counted)."""
    system_prompt: str | None = None
    """System prompt given to every pair (None: the one `posttrain pairs` sampled them with, from the
    pairs file's provenance; else none)."""
    use_chat_template: bool | None = None
    """Render prompts with the tokenizer's chat template (None: when it has one)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (None: no limit)."""
    max_response_tokens: int | None = None
    """Longest chosen/rejected response in tokens, EOS included (None: no limit)."""
    prompt_truncation: Literal["error", "left", "drop"] = "error"
    """Over-long prompt: error (named by file line), keep its last tokens, or drop the pair."""
    response_truncation: Literal["right", "drop", "error"] = "right"
    """Over-long response: keep its first tokens, drop the pair, or error."""

    def truncation(self) -> TruncationPolicy:
        return TruncationPolicy(self.max_prompt_tokens, self.max_response_tokens, self.prompt_truncation, self.response_truncation)


@dataclass
class Loss:
    """Link 3, loss: the objective, beta, length handling, reference handling."""

    type: Literal["sigmoid", "conservative", "robust", "ipo", "hinge", "length_normalized", "length_normalized_ipo"] = "sigmoid"
    """sigmoid (DPO; cDPO with label_smoothing, unlike TRL's sigmoid) | conservative (cDPO) | robust | ipo (summed
    log-ratios) | hinge | length_normalized (token-mean objective, TRL's sigmoid_norm) | length_normalized_ipo
    (token-mean IPO, TRL's ipo)."""
    beta: float = 0.1
    """Inverse temperature of the implicit reward beta * (log pi - log pi_ref)."""
    label_smoothing: float = 0.0
    """Assumed label-flip rate (sigmoid, conservative: > 0, robust)."""
    nll_weight: float = 0.0
    """RPO (arXiv:2404.19733): add weight * token-mean NLL of the chosen responses (0: off)."""
    reference: Literal["live", "precomputed"] = "live"
    """live: a frozen copy (or, with LoRA, the base with adapters off); precomputed: one pass at start, cached."""
    reference_refresh_every: int = 0
    """TR-DPO hard update (arXiv:2404.09656): copy the policy into the reference every N steps (0: never)."""


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
        loss = self.loss
        if not self.data.pairs:
            raise UserError("data.pairs: give the preference JSONL to train on (--data.pairs FILE)")
        if self.data.format is not None or self.data.columns:
            resolve_columns(self.data.format, self.data.columns)
        if loss.beta <= 0:
            raise UserError(f"loss.beta must be > 0, got {loss.beta}")
        if loss.type not in LABEL_SMOOTHED and loss.label_smoothing:
            raise UserError(f"loss.label_smoothing applies to {', '.join(LABEL_SMOOTHED)}, not {loss.type}")
        low = 0.0 if loss.type != "conservative" else 1e-12
        if not low <= loss.label_smoothing < 0.5:
            raise UserError(f"loss.label_smoothing must be in {'(0' if low else '[0'}, 0.5) for {loss.type}, got {loss.label_smoothing}")
        if loss.nll_weight < 0 or loss.reference_refresh_every < 0:
            raise UserError("loss.nll_weight and loss.reference_refresh_every must be >= 0")
        if loss.reference_refresh_every and loss.reference == "precomputed":
            raise UserError("loss.reference_refresh_every needs a live reference (loss.reference: live)")
        if loss.reference_refresh_every and self.lora_rank:
            raise UserError("loss.reference_refresh_every: a LoRA reference is the base model and cannot be refreshed")
        for name in ("batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.data.heldout_pairs < 0 or self.acceptance.alarm_window < 1 or self.acceptance.max_new_tokens < 1:
            raise UserError("data.heldout_pairs must be >= 0; acceptance.alarm_window and max_new_tokens >= 1")
        if self.acceptance.sets is not None:
            check_set_specs(self.acceptance.sets)
