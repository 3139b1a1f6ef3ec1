"""The seeded epoch stream every online recipe draws its training prompts from."""

from __future__ import annotations

import random

from posttrain.data.examples import Example, Task, derived_seed


class PromptStream:
    """An endless, seeded stream of training examples: epoch after epoch, each a fresh permutation.
    `position` (saved in checkpoints) is how many examples have been taken."""

    def __init__(self, task: Task, seed: int, position: int = 0):
        self.task, self.seed, self.position = task, seed, position

    def take(self, count: int) -> list[Example]:
        size = len(self.task.examples)
        taken = []
        while len(taken) < count:
            epoch, offset = divmod(self.position, size)
            order = list(range(size))
            random.Random(derived_seed(self.seed, "epoch", str(epoch))).shuffle(order)
            step = min(count - len(taken), size - offset)
            taken += [self.task.examples[i] for i in order[offset : offset + step]]
            self.position += step
        return taken
