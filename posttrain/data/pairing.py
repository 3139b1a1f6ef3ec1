"""Preference pairs from one prompt's scored answers: a correct answer (chosen) against an incorrect
one (rejected), distinct texts only, each answer reused as little as possible. `posttrain pairs`
(recipes/pairs.py) samples and scores the G answers of every prompt, and writes what this pairs.

    pairs, outcome = pair_up(texts, verdicts, threshold=1.0, limit=1)   # [(chosen, rejected)], "paired"
"""

from __future__ import annotations

from posttrain.rewards.verdict import Verdict


def pair_up(texts: list[str], verdicts: list[Verdict], threshold: float, limit: int) -> tuple[list[tuple[int, int]], str]:
    """(chosen index, rejected index) pairs among one prompt's G answers, and the group's outcome:
    `paired`, `all_correct`, `all_incorrect` or `unscored` (no ok verdict).

    Distinct texts only; pairs are taken in the order (0,0), (0,1), (1,0), (1,1), (0,2)... over the
    correct and incorrect answers, so each answer is reused as little as possible.
    """
    correct, incorrect, seen = [], [], set()
    for index, (text, verdict) in enumerate(zip(texts, verdicts)):
        if verdict.status != "ok" or verdict.reward is None or text in seen:
            continue
        seen.add(text)
        (correct if verdict.reward >= threshold else incorrect).append(index)
    if not correct and not incorrect:
        return [], "unscored"
    if not incorrect:
        return [], "all_correct"
    if not correct:
        return [], "all_incorrect"
    order = sorted(((i, j) for i in range(len(correct)) for j in range(len(incorrect))), key=lambda ij: (max(ij), ij))
    return [(correct[i], incorrect[j]) for i, j in order[:limit]], "paired"
