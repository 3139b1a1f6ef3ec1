"""The per-problem rows of a held-out evaluation, as its eval file keeps them and `posttrain review`
shows them, and the check that the checker could read the completions' answers at all.

A row: id, prompt (as the model saw it), gold (the example's gold answer; None for a code problem,
whose tests decide), completion, extracted (the final answer the checker read; None when it read
none or does not extract), reward, status, reason. With the gold and the extracted answer beside
the completion, a reviewer checks the checker without solving the problem.

When most scored completions have no final answer the checker can read (a model that ends with
`The answer is 33` under a policy that wants `\\boxed{}`), every score is 0 for a reason that is
not the model's arithmetic: `check_extraction` says so once per evaluation, with one example and
the settings that change it (the instruction, the token budget, the policy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from posttrain.data.examples import Example
from posttrain.rewards.extract import POLICIES
from posttrain.rewards.verdict import Verdict

logger = logging.getLogger(__name__)

POLICY_SETTING = "reward_options.extraction"
INSTRUCTION_SETTING = "task_options.instruction"
BUDGET_SETTING = "acceptance.max_new_tokens"


def heldout_rows(examples: Sequence[Example], prompts: Sequence[str], completions: Sequence[str],
                 verdicts: Sequence[Verdict]) -> list[dict[str, Any]]:
    """One eval-file row per problem (see the module docstring), in order."""
    return [{"id": example.id, "prompt": prompt, "gold": example.answer, "completion": completion,
             "extracted": verdict.details.get("extracted"), "reward": verdict.reward, "status": verdict.status,
             "reason": verdict.reason}
            for example, prompt, completion, verdict in zip(examples, prompts, completions, verdicts)]


def unextracted(verdicts: Sequence[Verdict]) -> list[int]:
    """The positions of the scored verdicts whose checker read no final answer: status ok, an
    `extraction` policy in the details and `extracted` None (code checkers record no policy)."""
    return [index for index, verdict in enumerate(verdicts)
            if verdict.status == "ok" and "extraction" in verdict.details and verdict.details.get("extracted") is None]


def check_extraction(name: str, completions: Sequence[str], verdicts: Sequence[Verdict]) -> int:
    """The number of `completions` of held-out set `name` whose final answer the checker could not
    read (`unextracted`); when that is more than half of those it tried to read, one warning: the
    count, the policy, one completion's end and its reason, and the three settings to change (the
    prompts' instruction, the token budget, a completion cut off before its answer, and the policy).

    Example: 27 of 30 unread -> "held-out gsm8k.jsonl: 27 of 30 completions have no final answer the
    checker can read (extraction boxed_or_tags), e.g. '... The answer is 33' (no <answer> element or
    \\boxed{}); say where the answer goes (task_options.instruction), leave room for it
    (acceptance.max_new_tokens) or read it another way (reward_options.extraction: boxed_or_tags | ...)".
    """
    failed = unextracted(verdicts)
    tried = sum(verdict.status == "ok" and "extraction" in verdict.details for verdict in verdicts)
    if failed and 2 * len(failed) > tried:
        first = verdicts[failed[0]]
        tail = " ".join(completions[failed[0]].split())[-80:]
        logger.warning("held-out %s: %d of %d completions have no final answer the checker can read (extraction %s), "
                       "e.g. %r (%s); say where the answer goes (%s), leave room for it (%s) or read it "
                       "another way (%s: %s)", name, len(failed), tried, first.details["extraction"],
                       ("... " if len(tail) == 80 else "") + tail, first.reason, INSTRUCTION_SETTING, BUDGET_SETTING,
                       POLICY_SETTING, " | ".join(POLICIES))
    return len(failed)
