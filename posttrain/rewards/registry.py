"""Verifiers by name (the reward-kind registry: `REWARD_KINDS`, `PREFIXED_KINDS`, `register_reward`),
and weighted composition.

Names: `math`, `exact`, `numeric`, `choice`, `integer`, `letter`, `text_match`, `math_equal` and `rg_answer` (checkers), `format`, `rg`, `humaneval`, `mbpp`, `io`, `stdio`,
`callable:<dotted.path>`, `rm:<directory>`, `judge:<model>`, `teacher:<model>` (a dense, per-token reward), and sums of them such as `0.9*math+0.1*format` (a missing weight is 1).
`as_verifier` turns what a recipe was given (a Verifier, a plain callable, or nothing and a name)
into one verifier.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.errors import UserError
from posttrain.rewards.answers import ChoiceVerifier, ExactVerifier, MathVerifier, NumericVerifier
from posttrain.rewards.base import Verifier
from posttrain.rewards.checkers import IntegerChecker, LetterChecker, MathChecker, StoredAnswerChecker, TextMatchChecker
from posttrain.rewards.code import CODE_POLICIES, CODE_TESTS, HumanEvalVerifier, IOVerifier, MBPPVerifier, StdioVerifier
from posttrain.rewards.custom import BatchFunctionVerifier, CallableVerifier, FunctionVerifier
from posttrain.rewards.format import FormatVerifier
from posttrain.rewards.overlong import Overlong
from posttrain.rewards.gym import ReasoningGymVerifier
from posttrain.rewards.sandbox import SandboxConfig
from posttrain.rewards.verdict import Verdict

CODE_VERIFIERS = {"humaneval": HumanEvalVerifier, "mbpp": MBPPVerifier, "io": IOVerifier, "stdio": StdioVerifier}
ANSWER_VERIFIERS = {"math": MathVerifier, "exact": ExactVerifier, "numeric": NumericVerifier,
                    "choice": ChoiceVerifier, "rg": ReasoningGymVerifier}
CHECKERS = {"integer": IntegerChecker, "letter": LetterChecker, "text_match": TextMatchChecker, "math_equal": MathChecker,
            "rg_answer": StoredAnswerChecker}
"""Checkers written apart from the training rewards (posttrain/rewards/checkers.py)."""


class WeightedSum(Verifier):
    """reward = sum of weight * component reward; each component's value is kept in details.

    Any component's infra_error or data_error makes the whole verdict that status (a sum with a
    missing term is not the same reward).
    """

    def __init__(self, components: Sequence[tuple[float, Verifier]]):
        if not components:
            raise ValueError("a weighted sum needs at least one component")
        self.components = list(components)
        self.name = "+".join(f"{weight:g}*{verifier.name}" for weight, verifier in self.components)

    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]],
              workers: int | None = None) -> list[Verdict]:
        """Score with every component, then combine per row."""
        columns = [verifier.batch(completions, examples, workers) for _, verifier in self.components]
        verdicts = []
        for row in zip(*columns):
            parts = {verifier.name: verdict.reward for (_, verifier), verdict in zip(self.components, row)}
            broken = [(verifier.name, verdict) for (_, verifier), verdict in zip(self.components, row)
                      if verdict.status != "ok"]
            if broken:
                name, verdict = broken[0]
                verdicts.append(Verdict(None, verdict.status, f"{name}: {verdict.reason}", {"components": parts}))
                continue
            total = sum(weight * verdict.reward for (weight, _), verdict in zip(self.components, row))
            reasons = "; ".join(f"{v.name}: {verdict.reason}" for (_, v), verdict in zip(self.components, row))
            verdicts.append(Verdict.ok(total, reasons, components=parts))
        return verdicts

    def score(self, completion: str, example: Mapping) -> Verdict:
        """One row (see `batch`)."""
        return self.batch([completion], [example])[0]

    def implementation(self) -> dict[str, str]:
        """Every part of every term."""
        return {f"{key} ({verifier.name})": value for _, verifier in self.components for key, value in verifier.implementation().items()}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name,
                "components": [{"weight": w, **v.describe()} for w, v in self.components]}

    @property
    def dense(self) -> bool:
        """Whether any term is dense (a teacher's per-token reward)."""
        return any(verifier.dense for _, verifier in self.components)

    def token_terms(self, rollout, owners, world) -> list:
        """Every dense term of every component, its weight times the component's."""
        return [type(term)(term.name, weight * term.weight, term.logprobs)
                for weight, verifier in self.components for term in verifier.token_terms(rollout, owners, world)]


@dataclass(frozen=True)
class RewardContext:
    """What a reward kind's factory may use beyond its name: the sandbox limits and reward settings,
    and where the run's models live (a reward model or a judge runs on `placement`'s device, batched,
    and knows its rank from `world`)."""

    sandbox: SandboxConfig | None = None
    fraction: bool = False
    """Code rewards: tests passed / total instead of all-or-nothing."""
    extraction: str | None = None
    """Answer rewards and checkers: the extraction policy (None: each row's own, else boxed_or_tags)."""
    tests: str = "all"
    """Code rewards: which of a row's tests run (`CODE_TESTS`)."""
    placement: Any = None
    """The run's `hardware.Placement` (device, precision); None: the CPU in float32."""
    world: Any = None
    """The run's `distributed.World`; None: one process."""
    batch_size: int = 16
    """Model-based rewards (rm:, judge:): rows per forward."""
    normalisation: str = "stored"
    """rm:: stored | batch | none (`RewardOptions.normalisation`)."""
    clip: float | None = None
    """rm:: clamp the normalised reward to [-clip, clip]; None: no clamp."""
    offload: str | None = None
    """rm:, judge:, teacher:: `cpu` keeps the scoring model on the CPU between calls."""
    tokenizer: Any = None
    """The policy's tokenizer (teacher:: the teacher's must be the same; None: not checked)."""
    temperature: float = 1.0
    """teacher:: the sampling temperature, at which the teacher's log-probs are taken (the student's are)."""


RewardFactory = Callable[[str, RewardContext], Verifier]
"""factory(spec, context) -> Verifier: `spec` is the part after `<kind>:` for a prefixed kind, else the name."""

REWARD_KINDS: dict[str, RewardFactory] = {
    **{name: (lambda spec, context, kind=kind: kind(**({"extraction": context.extraction} if context.extraction else {})))
       for name, kind in ANSWER_VERIFIERS.items()},
    **{name: (lambda spec, context, kind=kind: kind(extraction=context.extraction)) for name, kind in CHECKERS.items()},
    "format": lambda spec, context: FormatVerifier(),
    **{name: (lambda spec, context, kind=kind: kind(sandbox=context.sandbox, fraction=context.fraction, tests=context.tests))
       for name, kind in CODE_VERIFIERS.items()},
}
"""Reward kinds by name: one entry per verifier a config can name."""
def _reward_model(directory: str, context: RewardContext) -> Verifier:
    """rm:<directory>: a `posttrain rm` export on the run's device (imported here: it needs torch and transformers)."""
    if not directory:
        raise ValueError("rm:<directory>: name the reward model's directory, e.g. rm:runs/rm/final")
    from posttrain.rewards.reward_model import RewardModelVerifier

    return RewardModelVerifier(directory, context.placement, batch_size=context.batch_size, normalisation=context.normalisation,
                               clip=context.clip, offload=context.offload)


PREFIXED_KINDS: dict[str, tuple[RewardFactory, str]] = {
    "callable": (lambda path, context: CallableVerifier(path), "callable:<dotted.path>"),
    "rm": (_reward_model, "rm:<directory>"),
}
"""Reward kinds named `<kind>:<spec>`, each (factory, how it is written): callable:<dotted.path>, rm:<directory>."""


def register_reward(name: str, factory: RewardFactory, usage: str | None = None) -> None:
    """Add a reward kind: `name` then builds `factory(name, context)`; with `usage` (how it is
    written, e.g. "rm:<directory>") it is a prefixed kind and `name:<spec>` builds `factory(spec, context)`."""
    if name in REWARD_KINDS or name in PREFIXED_KINDS:
        raise ValueError(f"reward kind {name!r} is already registered")
    if usage is None:
        REWARD_KINDS[name] = factory
    else:
        PREFIXED_KINDS[name] = (factory, usage)


def get_verifier(name: str, *, sandbox: SandboxConfig | None = None, fraction: bool = False,
                 extraction: str | None = None, tests: str = "all", placement: Any = None, world: Any = None) -> Verifier:
    """Build a verifier from its name (see the module docstring) through the reward-kind registry.

    `sandbox` sets the limits of code verifiers (and `unsafe_no_sandbox`); `fraction` makes
    code rewards passed/total instead of all-or-nothing; `extraction` overrides the answer
    extraction policy of math/exact/numeric/rg and of the answer checkers (None: each row's own); `tests` which of a row's tests code verifiers run
    (`CODE_TESTS`: all, half); `placement` and `world` where model-based rewards run.
    """
    return build_reward(name, RewardContext(sandbox=sandbox, fraction=fraction, extraction=extraction, tests=tests,
                                            placement=placement, world=world))


def build_reward(name: str, context: RewardContext) -> Verifier:
    """The verifier `name` names in `context`: a weighted sum of kinds, `<kind>:<spec>`, or a kind."""
    name = name.strip()
    if "+" in name or "*" in name:
        components = []
        for term in name.split("+"):
            match = re.fullmatch(r"\s*(?:([0-9.eE-]+)\s*\*)?\s*(\S+?)\s*", term)
            if not match:
                raise ValueError(f"cannot read verifier term {term!r} in {name!r}")
            weight = float(match.group(1)) if match.group(1) else 1.0
            components.append((weight, build_reward(match.group(2), context)))
        return WeightedSum(components)
    kind, separator, spec = name.partition(":")
    if separator and kind in PREFIXED_KINDS:
        return PREFIXED_KINDS[kind][0](spec, context)
    if name in REWARD_KINDS:
        return REWARD_KINDS[name](name, context)
    raise ValueError(f"unknown verifier {name!r}; choose from {', '.join(REWARD_KINDS)}, "
                     + ", ".join(usage for _, usage in PREFIXED_KINDS.values()) + " or a weighted sum like 0.9*math+0.1*format")


@dataclass(frozen=True)
class RewardOptions:
    """A recipe's `reward_options` section: the settings of the verifier it builds by name."""

    timeout_s: float = 10.0
    """Code verifiers: wall-clock seconds for one completion (all its tests)."""
    memory_mb: int = 1024
    """Code verifiers: the candidate's address-space limit."""
    partial_credit: bool = False
    """Code verifiers: reward = tests passed / total instead of all-or-nothing (training reward only)."""
    extraction: str | None = None
    """Answer rewards and checkers: how the final answer is taken from a completion, one of boxed_or_tags,
    boxed, tags, hashes (`#### N`), marked (any of those three), last_number (rewards/extract.py); None:
    each row's own, its gold format's convention (GSM8K files: marked), else boxed_or_tags. Code
    verifiers: auto | fenced | raw."""
    tests: str = "half"
    """Code verifiers as the training reward: `half` runs every other test of each problem (the 1st,
    3rd ...), so that the held-out checker, which always runs all of them, holds tests the policy was
    never rewarded on (an independent check); `all` trains on every test (the run card then says the
    checker is not independent)."""
    batch_size: int = 16
    """Model-based rewards (rm:, judge:): completions per forward."""
    normalisation: str = "stored"
    """rm:: stored ((r - mean) / population std, as stored with the reward model at export) | batch (over each batch's rows) | none."""
    clip: float | None = None
    """rm:: clamp the normalised reward to [-clip, clip] (None: no clamp)."""
    truncated: str = "score"
    """Online training: a completion that reached max_new_tokens without stopping is scored as is (`score`), scored minus x
    (`penalty:<x>`, TRL's missing_eos_penalty), or left out of the baselines and the loss (`exclude`, counted as a data error)."""
    overlong: Overlong = field(default_factory=Overlong)
    """Online training: DAPO's soft overlong punishment (arXiv:2503.14476 eq. 13), added to each ok reward after `truncated`: 0 up to max_tokens - buffer policy tokens, then linear to -penalty at max_tokens, -penalty beyond (`rewards/overlong.py`; off unless max_tokens is set)."""
    offload: str | None = None
    """rm: and judge:: `cpu` keeps the scoring model on the CPU between scoring calls (moved to the run's device for each), freeing GPU memory for training."""

    def __post_init__(self):
        if self.tests not in CODE_TESTS:
            raise UserError(f"reward_options.tests: one of {', '.join(CODE_TESTS)}, got {self.tests!r}")
        if self.timeout_s <= 0 or self.memory_mb < 64:
            raise UserError(f"reward_options: timeout_s must be > 0 and memory_mb >= 64, got {self.timeout_s}, {self.memory_mb}")
        if self.normalisation not in ("stored", "batch", "none"):
            raise UserError(f"reward_options.normalisation: one of stored, batch, none, got {self.normalisation!r}")
        if self.truncated not in ("score", "exclude") and not _is_penalty(self.truncated):
            raise UserError(f"reward_options.truncated: score, exclude or penalty:<number>, got {self.truncated!r}")
        if self.offload not in (None, "cpu"):
            raise UserError(f"reward_options.offload: cpu or unset, got {self.offload!r}")
        if self.batch_size < 1 or (self.clip is not None and self.clip <= 0):
            raise UserError(f"reward_options: batch_size must be >= 1 and clip > 0, got {self.batch_size}, {self.clip}")

    def sandbox(self, unsafe_no_sandbox: bool = False) -> SandboxConfig:
        return SandboxConfig(timeout_s=self.timeout_s, memory_mb=self.memory_mb, unsafe_no_sandbox=unsafe_no_sandbox)


def as_verifier(reward: Verifier | Callable[[str, dict], Any] | None, name: str, options: RewardOptions | None = None,
                unsafe_no_sandbox: bool = False, *, for_checker: bool = False, setting: str | None = None,
                placement: Any = None, world: Any = None, tokenizer: Any = None, temperature: float = 1.0) -> Verifier:
    """The reward a recipe scores with: a `Verifier` as is; an object with a `batch(completions,
    examples)` method as a `BatchFunctionVerifier` (one call per batch); a plain callable
    `fn(completion, example)` as a `FunctionVerifier` (in this process, named `python:<qualname>`);
    otherwise (None) the verifier called `name` with `options`, built in the run's `placement` and
    `world` (a held-out checker, `for_checker`, never takes partial credit; a teacher checks its
    tokenizer against the policy's `tokenizer` and reads log-probs at `temperature`), whose ValueError becomes
    a one-line `UserError` naming `setting` (default `reward`, or `acceptance.checker` for a checker)."""
    if isinstance(reward, Verifier):
        return reward
    if callable(getattr(reward, "batch", None)):
        return BatchFunctionVerifier(reward)
    if callable(reward):
        return FunctionVerifier(reward)
    options = options or RewardOptions()
    try:
        verifier = build_reward(name, RewardContext(
            sandbox=options.sandbox(unsafe_no_sandbox), fraction=options.partial_credit and not for_checker,
            extraction=None if _is_code(name) else options.extraction, tests="all" if for_checker else options.tests,
            placement=placement, world=world, batch_size=options.batch_size, normalisation=options.normalisation, clip=options.clip,
            offload=options.offload, tokenizer=tokenizer, temperature=temperature))
    except (ValueError, TypeError) as error:
        raise UserError(f"{setting or ('acceptance.checker' if for_checker else 'reward')}: {error}") from None
    if options.extraction and _is_code(name):
        if options.extraction not in CODE_POLICIES:
            raise UserError(f"reward_options.extraction {options.extraction!r}: a code verifier takes one of {', '.join(CODE_POLICIES)}")
        verifier.code_policy = options.extraction
    return verifier


def _is_penalty(policy: str) -> bool:
    try:
        return policy.startswith("penalty:") and float(policy.removeprefix("penalty:")) >= 0
    except ValueError:
        return False


def _is_code(name: str) -> bool:
    return name.strip() in CODE_VERIFIERS


def _judge_factory(spec: str, context: RewardContext) -> Verifier:
    """`judge:<model>[,mode=generate][,max_score=K][,batch_size=N]`: a local LLM judge
    (posttrain/rewards/judge.py) on the run's placement, `reward_options.batch_size` rows per forward
    unless the spec says; imported here so that `import posttrain.rewards` stays free of torch and
    transformers."""
    if not spec.strip():
        raise ValueError("judge:<model>: name the judge model, e.g. judge:smollm2-135m")
    from posttrain.rewards.judge import judge_from_spec

    return judge_from_spec(spec, placement=context.placement, batch_size=context.batch_size)


register_reward("judge", _judge_factory, "judge:<model>")


def _teacher_factory(spec: str, context: RewardContext) -> Verifier:
    """`teacher:<model>`: a frozen teacher scoring each sampled token (on-policy distillation,
    posttrain/rewards/teacher.py) on the run's placement, checked against the policy's tokenizer;
    imported here so that `import posttrain.rewards` stays free of torch and transformers."""
    from posttrain.rewards.teacher import TeacherReward

    return TeacherReward(spec, placement=context.placement, tokenizer=context.tokenizer, temperature=context.temperature,
                         batch_size=context.batch_size, offload=context.offload)


register_reward("teacher", _teacher_factory, "teacher:<model>")
