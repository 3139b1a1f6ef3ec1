"""Environments: a stateful world a tool episode talks to, one instance per episode.

Where a `tools.Toolbox` is stateless (the same call gives the same result in any row), an
environment keeps state across the turns of one episode (a game board, a file system, a
conversation with a simulated user) and may give rewards as it goes. Write a class:

    class Guess:
        '''Guess the example's number: each guess gets "higher", "lower" or "correct".'''

        def tools(self) -> list:            # the functions the model may call (schemas from their
            return [self.guess]             # signatures and docstrings), or JSON schemas

        def reset(self, example) -> None:   # a new episode: the row's data record (Example)
            self.target, self.tries = int(example.answer), 0

        def step(self, call) -> Step:       # one tool call (`tool_calls.ToolCall`): what the model reads
            ...
            return Step(observation="lower", reward=None, done=False)

        def guess(self, n: int) -> str:
            '''Guess the number.

            Args:
                n: the guess.
            '''

and name it: `--tools.environment mymodule:Guess`. The episode sampler makes one instance per row
(`make_environment`: the factory is called with no argument) and resets it from the row's example,
so the G rows of a group start from the same state. Its steps run in the trainer's process, in
order (the environment is trusted code, as a reward function is; code the model writes belongs in
the `python` tool's sandbox). `step` raising is an error observation, counted, as a tool's
exception is. With `tools.reward: environment` the row's reward is the environment's (`last` or
`sum` of the rewards its steps gave, `tools.step_rewards`) instead of the verifier's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from posttrain.errors import UserError


@dataclass(frozen=True)
class Step:
    """What one environment step gives back."""

    observation: str
    """The text the model reads as the tool's result."""
    reward: float | None = None
    """A reward for this step (None: none)."""
    done: bool = False
    """The episode ends here (the observation is not appended: nobody reads it)."""


class Environment(Protocol):
    def tools(self) -> list[Any]:
        """The functions (or JSON schemas) the model may call."""
        ...

    def reset(self, example: Any) -> None:
        """Start an episode for `example` (the row's data record)."""
        ...

    def step(self, call: Any) -> Step:
        """Answer one tool call (`tools.ToolCall`: name, arguments, error)."""
        ...


def environment_factory(path: str) -> Callable[[], Environment]:
    """The class (or any no-argument factory) at `module:Name`; one line when it cannot be imported
    or lacks `reset`, `step` or `tools`."""
    from posttrain.rewards.custom import resolve

    try:
        factory = resolve(path)
    except (ImportError, AttributeError, ValueError) as error:
        raise UserError(f"tools.environment {path}: cannot import it ({error})") from None
    missing = [name for name in ("reset", "step", "tools") if not callable(getattr(factory, name, None))]
    if missing:
        raise UserError(f"tools.environment {path}: an environment needs the methods reset, step and tools; "
                        f"{', '.join(missing)} missing")
    return factory


def environment_schemas(factory: Callable[[], Environment]) -> list[dict]:
    """The JSON schemas of an environment's tools (functions through transformers' get_json_schema)."""
    from transformers.utils import get_json_schema

    schemas = []
    for tool in factory().tools():
        if isinstance(tool, dict):
            schemas.append(tool)
            continue
        try:
            schemas.append(get_json_schema(tool))
        except Exception as error:  # transformers raises its own DocstringParsingException / TypeHintParsingException
            raise UserError(f"tools.environment: tool {getattr(tool, '__name__', tool)!r} has no usable schema ({error})") from None
    return schemas


def environment_step(environment: Environment, call: Any) -> tuple[Step, str]:
    """One step, never raising for the model's mistakes: (the step, its status: ok | parse_error |
    error). A malformed call is answered by the parse error; `step` raising is an error observation."""
    if call.error:
        return Step(f"error: malformed tool call: {call.error}"), "parse_error"
    try:
        step = environment.step(call)
    except Exception as error:  # the environment's own exception: the model reads it, the episode goes on
        return Step(f"error: {type(error).__name__}: {str(error)[:300]}"), "error"
    if not isinstance(step, Step):
        raise UserError(f"tools.environment: step() must return an environments.Step, got {type(step).__name__}")
    return step, "ok"
