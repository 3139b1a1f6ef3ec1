"""Preference pairs from one prompt's scored answers: a correct answer (chosen) against an incorrect
one (rejected), distinct texts only, each answer reused as little as possible. `posttrain pairs`
(recipes/pairs.py) samples and scores the G answers of every prompt, and writes what this pairs.

    pairs, outcome = pair_up(texts, verdicts, threshold=1.0, limit=1)   # [(chosen, rejected)], "paired"
    labelled = label_all(texts, verdicts, threshold=1.0)  # KTO's rows: every distinct scored answer

`label_all` keeps what pairing discards: the answers of groups that are all correct or all incorrect
are still desirable or undesirable rows for an unpaired loss (KTO, arXiv:2402.01306).
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.rewards.verdict import Verdict


@dataclass
class Labelled:
    """One prompt's G answers sorted by their verdicts: indices of the distinct correct and incorrect
    answers (first occurrence of each text), the repeats dropped, and the group's outcome."""

    correct: list[int]
    incorrect: list[int]
    duplicates: int
    """ok-scored answers dropped because an earlier answer of the group had the same text."""
    outcome: str
    """paired (both kinds) | all_correct | all_incorrect | unscored (no ok verdict)."""


def label_all(texts: list[str], verdicts: list[Verdict], threshold: float) -> Labelled:
    """Each distinct ok-scored answer of one prompt, correct (reward >= threshold) or incorrect;
    infra and data errors are neither. Example: texts [a, a, b, c], rewards [1, 1, 0, error] ->
    correct [0], incorrect [2], 1 duplicate, outcome "paired"."""
    correct, incorrect, seen, duplicates = [], [], set(), 0
    for index, (text, verdict) in enumerate(zip(texts, verdicts)):
        if verdict.status != "ok" or verdict.reward is None:
            continue
        if text in seen:
            duplicates += 1
            continue
        seen.add(text)
        (correct if verdict.reward >= threshold else incorrect).append(index)
    outcome = ("paired" if correct and incorrect else "all_correct" if correct else "all_incorrect" if incorrect else "unscored")
    return Labelled(correct, incorrect, duplicates, outcome)


def pair_up(texts: list[str], verdicts: list[Verdict], threshold: float, limit: int) -> tuple[list[tuple[int, int]], str]:
    """(chosen index, rejected index) pairs among one prompt's G answers, and the group's outcome:
    `paired`, `all_correct`, `all_incorrect` or `unscored` (no ok verdict).

    Distinct texts only; pairs are taken in the order (0,0), (0,1), (1,0), (1,1), (0,2)... over the
    correct and incorrect answers, so each answer is reused as little as possible.
    """
    labelled = label_all(texts, verdicts, threshold)
    correct, incorrect = labelled.correct, labelled.incorrect
    if labelled.outcome != "paired":
        return [], labelled.outcome
    order = sorted(((i, j) for i in range(len(correct)) for j in range(len(incorrect))), key=lambda ij: (max(ij), ij))
    return [(correct[i], incorrect[j]) for i, j in order[:limit]], "paired"
