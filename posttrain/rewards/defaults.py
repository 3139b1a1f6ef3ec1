"""Who scores a task when nobody names a verifier: the training reward and the held-out checker of
each kind of gold answer (`Task.reward_kind`), the checker written apart from the reward
(`checkers.py`) so acceptance is independent of what was optimised.

    default_reward("number")                      # "exact"
    default_checker("number")                     # "integer"
    default_checker("reasoning_gym", ["leg_counting"])  # "rg_answer" (the stored answer decides)
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_REWARDS = {"number": "exact", "math": "math", "text": "exact", "choice": "choice", "reasoning_gym": "rg", "code": "humaneval",
                   "mbpp": "mbpp", "stdio": "stdio"}
"""The training reward (and `posttrain pairs`' labeller) of each kind of task when none is named."""
DEFAULT_CHECKERS = {**DEFAULT_REWARDS, "number": "integer", "math": "math_equal", "choice": "letter", "text": "text_match",
                    "reasoning_gym": "rg_answer"}
"""The held-out checker of each kind of task when none is named, each implemented apart from the
training reward (posttrain/rewards/checkers.py): numbers `integer`, math answers (MATH, GSM8K
files) `math_equal` (our LaTeX reader + sympy, not math-verify), option letters `letter`, free text
`text_match`, reasoning-gym `rg_answer` (the stored answer, where the dataset's scorer is that rule;
see `default_checker`); code: the same judge over all of a problem's tests, where the training
reward runs half of them (`reward_options.tests`)."""


def default_reward(kind: str) -> str | None:
    """The training reward's name for a task of gold-answer `kind` (None: no default; name one)."""
    return DEFAULT_REWARDS.get(kind)


def default_checker(kind: str, rg_datasets: Iterable[str] = ()) -> str:
    """The held-out checker's name for a task of gold-answer `kind` (`DEFAULT_CHECKERS`, else
    `exact`), except for reasoning-gym datasets (`rg_datasets`, their names) with a scorer of their
    own (several right answers, tolerances): only reasoning-gym's scorer knows what is right there,
    so the checker is `rg`, and the run card says it is not independent."""
    name = DEFAULT_CHECKERS.get(kind, "exact")
    if kind == "reasoning_gym":
        from posttrain.rewards.gym import scores_stored_answer

        if not all(isinstance(d, str) and scores_stored_answer(d) for d in rg_datasets):
            return "rg"
    return name
