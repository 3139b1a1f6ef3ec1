"""Rewards: verifiers that score completions, and the sandbox for untrusted code.

    from posttrain.rewards import as_verifier, get_verifier
    verifier = get_verifier("math")                   # or "humaneval", "0.9*math+0.1*format", ...
    verifier = as_verifier(my_function, "math")       # a Verifier, a plain callable, or None: by name
    verdict = verifier(completion, {"answer": "1/2"})  # -> Verdict(reward, status, reason, details)
    verdicts = verifier.batch(completions, examples, workers=4)

Every call returns a `Verdict`; see docs/rewards.md for the contracts and `posttrain audit`
for the exploit suite each shipped verifier must pass.
"""

from posttrain.rewards.base import Verifier
from posttrain.rewards.registry import REWARD_KINDS, RewardContext, RewardOptions, WeightedSum, as_verifier, get_verifier, register_reward
from posttrain.rewards.sandbox import SandboxConfig, SandboxUnavailable, check_isolation
from posttrain.rewards.verdict import Verdict

__all__ = ["REWARD_KINDS", "RewardContext", "register_reward", "SandboxConfig", "SandboxUnavailable", "Verdict", "Verifier", "WeightedSum",
           "RewardOptions", "as_verifier", "check_isolation", "get_verifier"]
