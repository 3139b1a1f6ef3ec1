"""Alarms that watch a run for the seed's warning, "the reward and the real goal can come apart":
the divergence alarm (training reward up, held-out accuracy not) for every online recipe, and the
likelihood-displacement alarm (DPO wins by pushing both answers down) for the preference recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DivergenceAlarm:
    """The seed's "reward and real goal can come apart": rings when the training reward rose by at
    least `reward_rise` over the last `window` evaluations while held-out accuracy rose by less than
    `heldout_rise` (it may have fallen).

    Feed it with `observe(step, train_reward, heldout_accuracy)` at each evaluation; it returns a
    message when it rings, else None. Rings once (the first evaluation that meets the condition;
    later ones while it holds, or after, stay quiet); `history` and `rings` are saved in checkpoints
    (as lists) so a resumed run rings the same.
    """

    window: int = 3
    reward_rise: float = 0.1
    heldout_rise: float = 0.0
    history: list[tuple[int, float, float]] = field(default_factory=list)
    rings: list[str] = field(default_factory=list)
    reward_spread: float | None = None
    """The reward's population std over the first scored step's rows, when those rewards are not all on
    [0, 1] (a learned reward model's scale is arbitrary): the rise that rings is then
    `reward_rise` x this spread, not an absolute `reward_rise`. None: absolute (a 0/1 verifier)."""

    def __post_init__(self):
        self.history = [tuple(h) for h in self.history or []]  # JSON gives the saved tuples back as lists
        self.rings = list(self.rings or [])
        self._calibrated = bool(self.history) or self.reward_spread is not None

    def calibrate(self, rewards: list[float]) -> None:
        """Once, from the first step's scored rewards: a reward off [0, 1] makes the threshold relative
        to their spread. Example: rewards [-1.2, 0.3, 0.9, -0.4] (spread 0.804) and reward_rise 0.1
        ring at a rise of 0.080."""
        if self._calibrated or not rewards:
            return
        self._calibrated = True
        if any(r < 0 or r > 1 for r in rewards):
            mean = sum(rewards) / len(rewards)
            spread = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
            self.reward_spread = spread if spread > 0 else None

    @property
    def threshold(self) -> float:
        """The training-reward rise that rings (absolute, or relative to `reward_spread`)."""
        return self.reward_rise * self.reward_spread if self.reward_spread else self.reward_rise

    def describe(self) -> str:
        if self.reward_spread:
            return (f"relative: a rise of {self.reward_rise:g} x the reward's spread at the start ({self.reward_spread:.4g}) = "
                    f"{self.threshold:.4g} (the reward is not on [0, 1])")
        return f"absolute: a rise of {self.reward_rise:g} in the training reward"

    def observe(self, step: int, train_reward: float, heldout_accuracy: float) -> str | None:
        self.history.append((step, train_reward, heldout_accuracy))
        if self.rings or len(self.history) < self.window:
            return None
        first_step, first_reward, first_heldout = self.history[-self.window]
        reward_change = train_reward - first_reward
        heldout_change = heldout_accuracy - first_heldout
        if reward_change >= self.threshold and heldout_change <= self.heldout_rise:
            message = (
                f"divergence: from step {first_step} to {step} the training reward rose by {reward_change:+.3f} "
                f"but held-out accuracy changed by {heldout_change:+.3f} - the verifier may be gamed"
            )
            self.rings.append(message)
            return message
        return None


@dataclass
class DisplacementAlarm:
    """Likelihood displacement (the seed: DPO can win by pushing both answers down): rings when the
    chosen log-ratio log pi(chosen) - log pi_ref(chosen), averaged over the last `window` steps, is
    below -threshold while the preference accuracy over those steps is above that of the run's first
    `window` steps.

    Feed it with `observe(step, chosen_logratio, accuracy)` every step; it returns a message when it
    rings, else None. Rings once; `history` and `rings` are saved in checkpoints (as lists) so a
    resumed run rings the same.
    """

    threshold: float = 5.0
    window: int = 5
    history: list[tuple[int, float, float]] = field(default_factory=list)
    rings: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.history = [tuple(h) for h in self.history or []]  # JSON gives the saved tuples back as lists
        self.rings = list(self.rings or [])

    def observe(self, step: int, chosen_logratio: float, accuracy: float) -> str | None:
        self.history.append((step, chosen_logratio, accuracy))
        if self.rings or len(self.history) < 2:
            return None
        recent, first = self.history[-self.window :], self.history[: self.window]
        drop = sum(h[1] for h in recent) / len(recent)
        accuracy_now, accuracy_start = sum(h[2] for h in recent) / len(recent), sum(h[2] for h in first) / len(first)
        if drop < -self.threshold and accuracy_now > accuracy_start:
            self.rings.append(
                f"likelihood displacement at step {step}: the chosen responses' log-prob is {drop:.3f} nats below the "
                f"reference's (threshold {self.threshold}) while preference accuracy rose {accuracy_start:.3f} -> "
                f"{accuracy_now:.3f}: DPO is winning by pushing both answers down"
            )
            return self.rings[-1]
        return None
