"""The training-signal check of an online run: is the reward giving the loss anything to learn from?

A reward that raises, returns NaN or a string on every row leaves every row `infra_error` or
`data_error`; a reward that never fires leaves every reward equal. Either way the reward moves no
advantage and the run, left alone, would end with exit 0 having learned nothing from it.
Whether a step had reward signal is the advantage estimator's own fact (`AdvantageEstimator.
silent_fraction`): for group estimators (group, rloo, reinforce_pp_baseline) some group's counted
rewards differed; for batch-level ones (reinforce_pp, gae) some two counted rewards of the batch
differed. `TrainingSignal` watches every step's rows and says so while the run goes:

- a warning when most of a step's rows could not be scored, naming the first reasons;
- a stop (`stop`: `SignalLost`, one line with the reward's own error and the `posttrain verify`
  command that replays the failing rows) when every row failed for `stop_after` steps in a row;
- an alarm that rings once in a run, when `window` steps in a row first had no reward signal at
  all (every row failed, or the estimator's every unit had equal rewards);
- the run card's "training_signal" section: error rates, the zero-variance group fraction, the
  steps without reward signal and without gradient.

Its counters are saved in checkpoints (`state()`), so a resumed run counts on from where it stopped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from posttrain.atomic import write_text_atomically
from posttrain.errors import UserError

logger = logging.getLogger(__name__)

FAILURES_FILE = "reward_failures.jsonl"
"""The rows a stopped run's reward could not score, in the run directory, as `posttrain verify --input` reads them."""


class SignalLost(UserError):
    """The reward failed on every row for several steps in a row: the run stops (a user's error,
    one line, non-zero exit)."""


@dataclass
class StepSignal:
    """What one step gave the loss: `rows` sampled, of which `infra_errors` and `data_errors`
    could not be scored (`reasons`: the first of those rows' reasons), the fraction of groups
    whose rewards were all equal (None: no groups, G = 1), the update's gradient norm (None: no
    update ran), and the fraction of the estimator's units without reward signal (`silent_fraction`,
    `AdvantageEstimator.silent_fraction`; None: not measured, the zero-variance fraction stands in)
    with what a unit is (`scope`: "group" or "batch")."""

    rows: int
    infra_errors: int = 0
    data_errors: int = 0
    reasons: list[str] = field(default_factory=list)
    zero_variance_fraction: float | None = None
    grad_norm: float | None = None
    silent_fraction: float | None = None
    scope: str = "group"

    @property
    def failed(self) -> int:
        return self.infra_errors + self.data_errors

    @property
    def silent(self) -> bool:
        """No reward signal: every row failed, or no unit of the estimator had rewards that differ."""
        fraction = self.silent_fraction if self.silent_fraction is not None else self.zero_variance_fraction
        return self.rows > 0 and (self.failed == self.rows or fraction == 1.0)

    @property
    def why_silent(self) -> str:
        """The reason a silent step had no reward signal, for the alarm."""
        if self.failed == self.rows:
            return "every row failed to score"
        return "every group's rewards were equal" if self.scope == "group" else "every reward in the batch was equal"


@dataclass
class TrainingSignal:
    """Watches each step's `StepSignal` (`observe`). `warn_fraction`: a step with more than this
    fraction of rows unscorable is warned about; `stop_after`: steps in a row with every row
    unscorable that stop the run (0: never); `window`: steps in a row without reward signal that
    ring the alarm (0: never). `verify`: the `posttrain verify --verifier` spelling of the reward
    (None: a Python object, which has none), for the stop's message."""

    warn_fraction: float = 0.5
    stop_after: int = 3
    window: int = 5
    verify: str | None = None
    steps: int = 0
    rows: int = 0
    infra_errors: int = 0
    data_errors: int = 0
    zero_variance_sum: float = 0.0
    grouped_steps: int = 0
    silent_steps: int = 0
    no_gradient_steps: int = 0
    failed_in_a_row: int = 0
    silent_in_a_row: int = 0
    rings: list[str] = field(default_factory=list)
    last: StepSignal | None = field(default=None, repr=False)

    def observe(self, step: int, signal: StepSignal) -> None:
        """Count `step`; warn about it, and ring the alarm, as the class says."""
        self._count(signal)
        self.last = signal
        if signal.rows and signal.failed / signal.rows > self.warn_fraction:
            logger.warning("step %d: the reward could not score %d of %d rows (%d infra_error, %d data_error); first: %s",
                           step, signal.failed, signal.rows, signal.infra_errors, signal.data_errors, "; ".join(signal.reasons[:3]))
        if self.window and self.silent_in_a_row == self.window and not self.rings:
            message = (f"training signal gone: for {self.window} steps in a row (to step {step}) the policy gradient had nothing of the "
                       f"reward's to follow ({signal.why_silent}); what moves the policy is the KL term, if any, or a critic's errors")
            self.rings.append(message)
            logger.warning(message)

    def stop(self, step: int, failures: list[dict[str, Any]], run_dir: Path | None = None, write: bool = True) -> None:
        """After `step` is logged and checkpointed: `SignalLost` when every row failed for
        `stop_after` steps in a row. `failures` (the step's unscorable rows: completion, the
        verifier's row, status, reason) go to `run_dir`/reward_failures.jsonl first (not with
        `write` False, as on ranks other than 0, whose message names the same file), so that the
        printed `posttrain verify` command replays them."""
        if not self.stop_after or self.failed_in_a_row < self.stop_after:
            return
        reasons = self.last.reasons if self.last else []
        message = (f"step {step}: the reward could not score any row for {self.failed_in_a_row} steps in a row "
                   f"({reasons[0] if reasons else 'no reason given'}); the run stops")
        if failures:
            path = Path(run_dir or ".") / FAILURES_FILE
            if run_dir is not None and write:
                write_text_atomically(path, "".join(json.dumps(row, default=str) + "\n" for row in failures))
            if self.verify is not None:
                message += f"; try the reward on those rows: posttrain verify --verifier '{self.verify}' --input {path}"
            else:
                message += f"; the failing rows are in {path}"
        raise SignalLost(message)

    def _count(self, signal: StepSignal) -> None:
        self.steps += 1
        self.rows += signal.rows
        self.infra_errors += signal.infra_errors
        self.data_errors += signal.data_errors
        if signal.zero_variance_fraction is not None:
            self.zero_variance_sum += signal.zero_variance_fraction
            self.grouped_steps += 1
        self.silent_steps += signal.silent
        self.no_gradient_steps += not signal.grad_norm
        self.failed_in_a_row = self.failed_in_a_row + 1 if signal.rows and signal.failed == signal.rows else 0
        self.silent_in_a_row = self.silent_in_a_row + 1 if signal.silent else 0

    def card(self) -> dict[str, Any]:
        """The run card's "training_signal" section."""
        return {
            "steps": self.steps, "rows": self.rows,
            "infra_error_rate": self.infra_errors / self.rows if self.rows else None,
            "data_error_rate": self.data_errors / self.rows if self.rows else None,
            "zero_variance_group_fraction": self.zero_variance_sum / self.grouped_steps if self.grouped_steps else None,
            "steps_without_reward_signal": self.silent_steps, "steps_without_gradient": self.no_gradient_steps,
            "alarm": self.rings[0] if self.rings else None,
        }

    def state(self) -> dict[str, Any]:
        """The counters, for a checkpoint (`TrainingSignal(**settings, **state)` restores them)."""
        settings = ("warn_fraction", "stop_after", "window", "verify", "last")
        return {key: value for key, value in asdict(self).items() if key not in settings}
