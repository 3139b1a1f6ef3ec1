"""Environments for tests/test_episodes.py (importable by path: `tests.environment_fixtures:Guess`)."""

from __future__ import annotations

from posttrain.rollout.environments import Step


class Guess:
    """Guess the example's number: each guess is answered higher / lower / correct, rewarded -0.1 per
    wrong guess and 1 for the right one, which ends the episode."""

    resets: list = []
    """Every (instance id, example answer) reset, across instances: the tests read it."""

    def tools(self):
        return [self.guess]

    def reset(self, example) -> None:
        self.target, self.tries = int(example.answer), 0
        Guess.resets.append((id(self), example.answer))

    def step(self, call) -> Step:
        if call.name != "guess":
            raise ValueError(f"no tool {call.name}")
        n = int(call.arguments["n"])
        self.tries += 1
        if n == self.target:
            return Step("correct", reward=1.0, done=True)
        return Step("higher" if n < self.target else "lower", reward=-0.1)

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: the guess.
        """
        return ""


class NoStep:
    """Not an environment: it has no step."""

    def tools(self):
        return []

    def reset(self, example) -> None:
        pass
