"""The uniform verifier call: `verifier(completion, example) -> Verdict` and `verifier.batch(...)`.

A verifier is a small object with a `score(completion, example)` method. Cheap string checks
(exact, numeric, format) score in the caller's process; anything that can hang or needs a main
thread or a sandbox slot (`in_worker = True`) is sent to the worker pool with a hard deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.rewards.pool import WorkerGone, get_pool
from posttrain.rewards.verdict import Verdict

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenTerm:
    """One dense (per-token) term of a batch's reward: a scoring model's log-probs of every sampled
    token, read against the student's own (`algorithms.distill.teacher_token_rewards`): the token
    reward is weight x (logprobs - the student's)."""

    name: str
    weight: float
    logprobs: Any
    """(N, T) float32 torch tensor, 0 off the rollout's mask."""

    def to(self, device) -> TokenTerm:
        return TokenTerm(self.name, self.weight, self.logprobs.to(device))


class Verifier:
    """Base class. Subclasses set `name`, implement `score`, and may set `in_worker`. A dense reward
    (a teacher's) also sets `dense` and implements `token_terms`: its `batch` then scores the
    sequence part (0 for a teacher alone)."""

    name = "verifier"
    in_worker = False
    dense = False
    """True: the reward has per-token terms (`token_terms`) beside the sequence verdicts."""
    timeout_s = 10.0
    """hard deadline for one `score` call in a worker (the pool kills the worker past it)"""
    retry_timeouts = False
    """retry once after a missed deadline (code judges: their own deadline should come first)"""

    def score(self, completion: str, example: Mapping[str, Any]) -> Verdict:
        """Score one completion. Runs in a worker process when `in_worker`."""
        raise NotImplementedError

    def on_worker_failure(self, error: Exception) -> Verdict:
        """What a dead/late worker or a raising scorer means for this verifier."""
        if isinstance(error, WorkerGone) and error.timed_out:
            return Verdict.infra_error(f"{self.name}: worker missed its {self.timeout_s:g} s deadline")
        return Verdict.infra_error(f"{self.name}: {error}")

    def implementation(self) -> dict[str, str]:
        """What this verifier's verdict rests on, part by part (`extraction`, `comparison`, `tests`,
        `judge`, ...), each named by its implementation: two verifiers that share a part are not
        independent checks of each other (`posttrain.evaluation.acceptance.independence`)."""
        return {"verifier": f"{type(self).__module__}.{type(self).__qualname__}"}

    def prepare(self) -> None:
        """Checks run once in the caller before a batch (e.g. refuse to run without a sandbox)."""

    def __call__(self, completion: str, example: Mapping[str, Any]) -> Verdict:
        """Score one completion (see `batch`)."""
        return self.batch([completion], [example])[0]

    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]],
              workers: int | None = None) -> list[Verdict]:
        """Score completions[i] against examples[i]; returns verdicts in input order.

        `workers` sizes the process pool for `in_worker` verifiers (default: CPU count).
        """
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        self.prepare()
        if not self.in_worker:
            return [_score_guarded(self, c, e) for c, e in zip(completions, examples)]
        pool = get_pool(workers)
        tasks = [(self, c, e) for c, e in zip(completions, examples)]
        return pool.map("posttrain.rewards.base:_score_guarded", tasks, timeout_s=self.timeout_s,
                        retry_timeouts=self.retry_timeouts, on_failure=self.on_worker_failure)

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name}

    def token_terms(self, rollout, owners, world) -> list[TokenTerm]:
        """The dense terms of a sampled batch (`rollout`: N rows; `owners` (N,) the rank that owns each
        row; `world` the run's `distributed.World`): none for a sequence-level verifier."""
        return []


def _score_guarded(verifier: Verifier, completion: Any, example: Any) -> Verdict:
    """Type checks shared by every verifier, then `score`; a scorer bug is infra_error."""
    if not isinstance(completion, str):
        return Verdict.data_error(f"completion must be a string, got {type(completion).__name__}")
    if not isinstance(example, Mapping):
        return Verdict.data_error(f"example must be a mapping, got {type(example).__name__}")
    try:
        verdict = verifier.score(completion, example)
    except Exception as error:  # noqa: BLE001 - our bug, not the candidate's: never a silent 0
        logger.exception("%s failed", verifier.name)
        return Verdict.infra_error(f"{verifier.name} raised {type(error).__name__}: {error}")
    if not isinstance(verdict, Verdict):
        return Verdict.infra_error(f"{verifier.name} returned {type(verdict).__name__}, not a Verdict")
    return verdict
