"""`rg`: reasoning-gym's own scorer for `rg:<task>` examples.

The example is a reasoning-gym entry (`question`, `answer`, `metadata.source_dataset`) or holds
one under `entry` or `metadata.entry` (as posttrain.data's `rg:` tasks do). The answer is extracted with the same explicit policy as `math` (default: the
final `\\boxed{}` or `<answer>` tag, several different answers score 0), then scored by
`reasoning_gym.get_score_answer_fn(<task>)` in a pool worker (some scorers use sympy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.extract import DEFAULT_POLICY, POLICIES, extract_answer, hedge
from posttrain.rewards.verdict import Verdict


@functools.lru_cache(maxsize=None)
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def scores_stored_answer(dataset: str) -> bool:
    """Whether reasoning-gym's scorer of `dataset` is its base rule, "equal to the stored answer"
    (partial credit for containing it), so that a checker comparing with the stored answer checks
    the same thing; False for datasets with their own scorer (several right answers, tolerances)."""
    from reasoning_gym.dataset import ProceduralDataset
    from reasoning_gym.factory import DATASETS

    return dataset in DATASETS and DATASETS[dataset][0].score_answer is ProceduralDataset.score_answer


class ReasoningGymVerifier(Verifier):
    """reasoning-gym's `score_answer(answer, entry)` on the extracted answer."""

    name = "rg"
    in_worker = True
    timeout_s = 20.0

    def __init__(self, extraction: str = DEFAULT_POLICY):
        if extraction not in POLICIES:
            raise ValueError(f"unknown extraction policy {extraction!r}; choose from {POLICIES}")
        self.extraction = extraction

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Extract, then call the task's scorer; a raising scorer is infra_error."""
        metadata = example.get("metadata")
        entry = example.get("entry") or (metadata.get("entry") if isinstance(metadata, Mapping) else None) or example
        metadata = entry.get("metadata") if isinstance(entry, Mapping) else None
        task = metadata.get("source_dataset") if isinstance(metadata, Mapping) else None
        if not isinstance(task, str) or "answer" not in entry:
            return Verdict.data_error("not a reasoning-gym entry: needs 'answer' and 'metadata.source_dataset'")
        try:
            scorer = _scorer(task)
        except ValueError:
            return Verdict.data_error(f"unknown reasoning-gym task {task!r}")
        found = extract_answer(completion, self.extraction)
        details = {"extraction": self.extraction, "extracted": found.answer, "task": task}
        if found.answer is None:
            return Verdict.ok(0.0, found.reason, **details)
        hedged = hedge(found.answer, str(entry["answer"]))
        if hedged:
            return Verdict.ok(0.0, f"hedged answer: {hedged}", **details)
        reward = float(scorer(found.answer, dict(entry)))
        if not math.isfinite(reward):
            return Verdict.infra_error(f"reasoning-gym scorer for {task} returned {reward}", **details)
        return Verdict.ok(reward, "correct" if reward >= 1.0 else "reasoning-gym score", **details)

    def implementation(self) -> dict[str, str]:
        """Our extraction, the dataset's own scorer."""
        return {"extraction": "posttrain.rewards.extract", "comparison": "reasoning_gym score_answer"}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name, "extraction": self.extraction}
