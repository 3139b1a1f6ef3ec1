"""The seeded order in which SFT and DPO visit their training rows."""

from __future__ import annotations

import random


def data_order(num_examples: int, seed: int, position: int, count: int) -> list[int]:
    """Indices `position .. position + count` of an endless stream of seeded epoch permutations of
    `range(num_examples)`: step s of a run with batch size b takes `data_order(n, seed, s * b, b)`,
    so a resumed run needs only its step to continue the same stream.

    The permutation of epoch e is `random.Random(seed * 1_000_003 + e)`'s shuffle. (The online
    recipes' `PromptStream` seeds its epochs with `derived_seed`; the two are kept apart so that
    existing SFT and DPO runs keep their data order.)
    """
    indices = []
    while len(indices) < count:
        epoch, offset = divmod(position + len(indices), num_examples)
        permutation = list(range(num_examples))
        random.Random(seed * 1_000_003 + epoch).shuffle(permutation)
        indices.extend(permutation[offset : offset + count - len(indices)])
    return indices
