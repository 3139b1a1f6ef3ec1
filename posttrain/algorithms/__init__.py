"""The algorithm catalogue: pure tensor functions (no models, configs, I/O or `.item()`).

Each function states its equation, its paper and its shapes; `docs/algorithms.md` maps each
algorithm, step by step, onto these functions.
"""

from posttrain.algorithms.advantages import (
    gae,
    group_statistics,
    grpo_advantages,
    masked_mean,
    rloo_advantages,
    whiten,
)
from posttrain.algorithms.importance import effective_sample_size, importance_weights, truncated_importance_weights
from posttrain.algorithms.kl import ESTIMATORS, exact_kl, kl_estimate, kl_penalized_rewards
from posttrain.algorithms.logprobs import head_logprobs, response_logprobs, sequence_logprobs, token_logprobs
from posttrain.algorithms.policy import AGGREGATIONS, aggregate, clipped_surrogate, clipped_value_loss, sampler_mismatch
from posttrain.algorithms.preference import (
    PAIR_METRICS,
    conservative_dpo_loss,
    dpo_loss,
    hinge_loss,
    ipo_loss,
    length_normalized_dpo_loss,
    pair_columns,
    pair_metrics,
    robust_dpo_loss,
)
from posttrain.algorithms.reference_free import KTO_CLASS_BALANCE_BAND, cpo_loss, kto_class_balance, kto_loss, orpo_loss, simpo_loss

__all__ = [
    "sampler_mismatch",
    "truncated_importance_weights",
    "importance_weights",
    "effective_sample_size",
    "AGGREGATIONS",
    "ESTIMATORS",
    "KTO_CLASS_BALANCE_BAND",
    "PAIR_METRICS",
    "aggregate",
    "clipped_surrogate",
    "clipped_value_loss",
    "conservative_dpo_loss",
    "cpo_loss",
    "dpo_loss",
    "exact_kl",
    "gae",
    "group_statistics",
    "grpo_advantages",
    "head_logprobs",
    "hinge_loss",
    "ipo_loss",
    "kl_estimate",
    "kl_penalized_rewards",
    "kto_class_balance",
    "kto_loss",
    "length_normalized_dpo_loss",
    "masked_mean",
    "orpo_loss",
    "pair_columns",
    "pair_metrics",
    "response_logprobs",
    "rloo_advantages",
    "robust_dpo_loss",
    "sequence_logprobs",
    "simpo_loss",
    "token_logprobs",
    "whiten",
]
