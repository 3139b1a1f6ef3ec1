"""A user's Python function as the reward: `fn(completion, example)` -> a number or a `Verdict`.

Two ways in, one rule for what comes back (`verdict_from_result`: a Verdict as is, a finite number
ok, bool counting as 0/1, anything else infra_error):

* `callable:<dotted.path>` (`CallableVerifier`): imported and run in a worker with a deadline; an
  exception is infra_error whose reason is the traceback's last line, and a missed deadline is
  infra_error too (a verifier that hangs is a verifier bug, not a wrong answer). The module is
  imported from the current directory first, then `sys.path` (as `python -m` does, and as the
  workers, `python -m posttrain.rewards.worker`, do), so `posttrain grpo --reward callable:my_reward.score`
  finds ./my_reward.py; a path that does not import is a ValueError when the verifier is built;
* a callable object (`FunctionVerifier`, what `as_verifier` makes of a plain callable): run in
  this process, because a function defined in a script or a notebook cannot be imported by a
  worker; it gets a plain dict copy of the example, and an exception is infra_error
  "<ExceptionType>: <message>";
* an object with a `batch(completions, examples)` method (`BatchFunctionVerifier`): one call per
  batch in this process (a model that scores rows together), returning one result per row.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.verdict import Verdict


def resolve(path: str):
    """Import `package.module.function` (or `package.module:function`), the current directory first
    on the import path (as `python -m` puts it; the `posttrain` script alone would not)."""
    module_name, separator, attribute = path.replace(":", ".").rpartition(".")
    if not separator or not module_name:
        raise ValueError(f"callable path must look like package.module.function, got {path!r}")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    function = getattr(importlib.import_module(module_name), attribute)
    if not callable(function):
        raise ValueError(f"{path} is not callable")
    return function


def load_error(path: str) -> str | None:
    """None if `path` imports as a callable (`resolve`), else why not, in one line naming where
    modules are looked for. Any exception of the module's own import (a SyntaxError, a missing
    package) is the reason too."""
    try:
        resolve(path)
    except Exception as error:  # noqa: BLE001 - the user's module: whatever stops its import is the answer
        reason = traceback.format_exception_only(type(error), error)[-1].strip()
        return (f"cannot load callable:{path}: {reason} (modules are imported from the current directory, "
                f"{os.getcwd()}, then PYTHONPATH)")
    return None


def verdict_from_result(result: Any, name: str, reason: str) -> Verdict:
    """A user function's return value as a Verdict: a Verdict as is; a finite number (bool: 0/1)
    `ok` with `reason`; anything else (NaN, a string, None) infra_error naming `name`.

    >>> verdict_from_result(True, "f", "user function")
    Verdict(reward=1.0, status='ok', reason='user function', details={})
    >>> verdict_from_result(float("nan"), "f", "user function").reason
    'f returned nan, not a finite number or Verdict'
    """
    if isinstance(result, Verdict):
        return result
    if isinstance(result, (bool, int, float)) and math.isfinite(float(result)):
        return Verdict.ok(float(result), reason)
    return Verdict.infra_error(f"{name} returned {result!r}, not a finite number or Verdict")


class CallableVerifier(Verifier):
    """Wraps a user function given by dotted path; scored in a worker."""

    in_worker = True

    def __init__(self, path: str, timeout_s: float = 10.0):
        self.path, self.timeout_s = path, timeout_s
        self.name = f"callable:{path}"
        self.prepare()  # a bad path fails where the verifier is named (one line there), before any work

    def prepare(self) -> None:
        """Fail fast (in the caller) on a path that does not import: a ValueError (`load_error`)."""
        problem = load_error(self.path)
        if problem is not None:
            raise ValueError(problem)

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Call the function; normalise its result to a Verdict."""
        try:
            result = resolve(self.path)(completion, example)
        except Exception as error:  # noqa: BLE001 - the user's bug, reported not hidden
            last = traceback.format_exception_only(type(error), error)[-1].strip()
            return Verdict.infra_error(last)
        return verdict_from_result(result, self.path, "user callable")

    def implementation(self) -> dict[str, str]:
        """The user's function."""
        return {"function": self.name}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name, "timeout_s": self.timeout_s}


class FunctionVerifier(Verifier):
    """Wraps a callable object (a function, a lambda, an instance with `__call__`); scored in
    this process. Its name is `python:<qualname>` (the type's name when it has no qualname)."""

    def __init__(self, function: Callable[[str, dict], Any]):
        self.function = function
        self.name = f"python:{getattr(function, '__qualname__', type(function).__name__)}"

    def implementation(self) -> dict[str, str]:
        """The user's function."""
        return {"function": self.name}

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Call the function on a dict copy of the example; normalise its result to a Verdict."""
        try:
            result = self.function(completion, dict(example))
        except Exception as error:  # noqa: BLE001 - the user's bug, reported, never a silent 0
            return Verdict.infra_error(f"{type(error).__name__}: {error}")
        return verdict_from_result(result, self.name, "user function")


class BatchFunctionVerifier(Verifier):
    """Wraps an object whose `batch(completions, examples)` returns one number or Verdict per row
    (in order); called once per batch in this process. An exception, or a result of the wrong
    length, makes every row of that batch infra_error naming it."""

    def __init__(self, scorer: Any):
        self.scorer = scorer
        self.name = f"python:{type(scorer).__qualname__}.batch"

    def implementation(self) -> dict[str, str]:
        """The user's scorer."""
        return {"function": self.name}

    def score(self, completion: str, example: Mapping) -> Verdict:
        """One row (see `batch`)."""
        return self.batch([completion], [example])[0]

    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]], workers: int | None = None) -> list[Verdict]:
        """One call of the scorer's batch on plain dict copies of the examples; each result as `verdict_from_result`."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        try:
            results = list(self.scorer.batch(list(completions), [dict(example) for example in examples]))
        except Exception as error:  # noqa: BLE001 - the user's bug, reported, never a silent 0
            return [Verdict.infra_error(f"{type(error).__name__}: {error}")] * len(completions)
        if len(results) != len(completions):
            return [Verdict.infra_error(f"{self.name} returned {len(results)} results for {len(completions)} rows")] * len(completions)
        return [verdict_from_result(result, self.name, "user batch scorer") for result in results]
