"""The one seeded epoch stream every recipe draws its training rows from: epoch after epoch, each a
fresh seeded permutation, addressed by position (so a resumed run needs only its position).

Two epoch seedings exist, each kept so that runs reproduce across versions: SFT and DPO seed epoch e
with `seed * 1_000_003 + e` (`data_order`), the online recipes with `derived_seed(seed, "epoch", e)`
(`PromptStream`). The permutation logic is one function, `epoch_indices`.
"""

from __future__ import annotations

import random
from typing import Callable

from posttrain.data.examples import Example, Task, derived_seed


def epoch_indices(size: int, position: int, count: int, epoch_seed: Callable[[int], int]) -> list[int]:
    """Indices `position .. position + count` of the endless stream of permutations of `range(size)`,
    epoch e shuffled by `random.Random(epoch_seed(e))`."""
    indices: list[int] = []
    while len(indices) < count:
        epoch, offset = divmod(position + len(indices), size)
        permutation = list(range(size))
        random.Random(epoch_seed(epoch)).shuffle(permutation)
        indices.extend(permutation[offset : offset + count - len(indices)])
    return indices


def data_order(num_examples: int, seed: int, position: int, count: int) -> list[int]:
    """SFT's and DPO's rows: step s of a run with batch size b takes `data_order(n, seed, s * b, b)`."""
    return epoch_indices(num_examples, position, count, lambda epoch: seed * 1_000_003 + epoch)


class PromptStream:
    """The online recipes' prompts: an endless, seeded stream of a task's training examples.
    `position` (saved in checkpoints) is how many examples have been taken."""

    def __init__(self, task: Task, seed: int, position: int = 0):
        self.task, self.seed, self.position = task, seed, position

    def take(self, count: int) -> list[Example]:
        indices = epoch_indices(len(self.task.examples), self.position, count, lambda epoch: derived_seed(self.seed, "epoch", str(epoch)))
        self.position += count
        return [self.task.examples[i] for i in indices]
