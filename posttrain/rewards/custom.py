"""`callable:<dotted.path>`: a user's Python function as the reward, in a worker with a deadline.

`fn(completion, example)` may return a number (bool counts as 0/1) or a `Verdict`. An exception
is infra_error whose reason is the traceback's last line; a missed deadline is infra_error too
(a verifier that hangs is a verifier bug, not a wrong answer).
"""

from __future__ import annotations

import importlib
import math
import traceback
from collections.abc import Mapping
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.verdict import Verdict


def resolve(path: str):
    """Import `package.module.function` (or `package.module:function`)."""
    module_name, separator, attribute = path.replace(":", ".").rpartition(".")
    if not separator or not module_name:
        raise ValueError(f"callable path must look like package.module.function, got {path!r}")
    function = getattr(importlib.import_module(module_name), attribute)
    if not callable(function):
        raise ValueError(f"{path} is not callable")
    return function


class CallableVerifier(Verifier):
    """Wraps a user function given by dotted path."""

    in_worker = True

    def __init__(self, path: str, timeout_s: float = 10.0):
        self.path, self.timeout_s = path, timeout_s
        self.name = f"callable:{path}"

    def prepare(self) -> None:
        """Fail fast (in the caller) on a path that does not import."""
        try:
            resolve(self.path)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(f"cannot load verifier callable {self.path!r}: {error}") from None

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Call the function; normalise its result to a Verdict."""
        try:
            result = resolve(self.path)(completion, example)
        except Exception as error:  # noqa: BLE001 - the user's bug, reported not hidden
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            return Verdict.infra_error(last)
        if isinstance(result, Verdict):
            return result
        if isinstance(result, (bool, int, float)) and math.isfinite(float(result)):
            return Verdict.ok(float(result), "user callable")
        return Verdict.infra_error(f"{self.path} returned {result!r}, not a finite number or Verdict")

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name, "timeout_s": self.timeout_s}
