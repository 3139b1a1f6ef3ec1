"""`Verdict`: what every reward call returns (docs/rewards.md).

A candidate's failure (wrong answer, crash, timeout, output flood) is `ok` with reward 0 and a
reason. A failure of ours (dead worker, broken sandbox, a user verifier that raises) is
`infra_error` with reward None: never a silent 0, so recipes can drop it from group baselines. A
malformed example (empty test list, unparseable gold answer) is `data_error`, also reward None.
"""

from __future__ import annotations

import dataclasses
from typing import Any

STATUSES = ("ok", "infra_error", "data_error")


@dataclasses.dataclass
class Verdict:
    """The score of one completion, with the reason and details (extracted answer, tests passed).

    >>> Verdict.ok(0.0, "wrong answer", extracted="41").to_json()
    {'reward': 0.0, 'status': 'ok', 'reason': 'wrong answer', 'details': {'extracted': '41'}}
    """

    reward: float | None
    status: str
    reason: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if (self.reward is None) != (self.status != "ok"):
            raise ValueError(f"reward must be a float exactly when status is ok ({self})")

    @classmethod
    def ok(cls, reward: float, reason: str, **details: Any) -> "Verdict":
        """A scored candidate (reward in [0, 1] for the built-in verifiers)."""
        return cls(float(reward), "ok", reason, details)

    @classmethod
    def infra_error(cls, reason: str, **details: Any) -> "Verdict":
        """We could not score it (worker/sandbox/verifier failure): excluded, counted in metrics."""
        return cls(None, "infra_error", reason, details)

    @classmethod
    def data_error(cls, reason: str, **details: Any) -> "Verdict":
        """The example itself is malformed: reject it before training."""
        return cls(None, "data_error", reason, details)

    def to_json(self) -> dict[str, Any]:
        """A plain dict for JSONL output (details included only when non-empty)."""
        row = {"reward": self.reward, "status": self.status, "reason": self.reason}
        if self.details:
            row["details"] = self.details
        return row
