"""Alarms that watch a run for the seed's warning, "the reward and the real goal can come apart":
the divergence alarm (training reward up, held-out accuracy not) for every online recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DivergenceAlarm:
    """The seed's "reward and real goal can come apart": rings when the training reward rose by at
    least `reward_rise` over the last `window` evaluations while held-out accuracy rose by less than
    `heldout_rise` (it may have fallen).

    Feed it with `observe(step, train_reward, heldout_accuracy)` at each evaluation; it returns a
    message when it rings, else None. `rings` keeps every message for the run card.
    """

    window: int = 3
    reward_rise: float = 0.1
    heldout_rise: float = 0.0
    history: list[tuple[int, float, float]] = field(default_factory=list)
    rings: list[str] = field(default_factory=list)

    def observe(self, step: int, train_reward: float, heldout_accuracy: float) -> str | None:
        self.history.append((step, train_reward, heldout_accuracy))
        if len(self.history) < self.window:
            return None
        first_step, first_reward, first_heldout = self.history[-self.window]
        reward_change = train_reward - first_reward
        heldout_change = heldout_accuracy - first_heldout
        if reward_change >= self.reward_rise and heldout_change <= self.heldout_rise:
            message = (
                f"divergence: from step {first_step} to {step} the training reward rose by {reward_change:+.3f} "
                f"but held-out accuracy changed by {heldout_change:+.3f} - the verifier may be gamed"
            )
            self.rings.append(message)
            return message
        return None
