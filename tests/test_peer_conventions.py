"""Our `aggregate` beside TRL's GRPO `loss_type`s and verl's `loss_agg_mode`s (docs/algorithms.md §6,
"Peers' names for the same reductions").

The peers' normalisations are written out here from their code (TRL 1.16
`GRPOTrainer._compute_loss`; verl `core_algos.agg_loss`), not imported. One process; per_token is
(N, T) = (6, 8), right-padded masks of lengths 8, 3, 5, 1, 6, 2 (every row counts at least one
token), and 100.0 at every padded position, so a reduction that reads padding is far off.
"""

import pytest
import torch

from posttrain.algorithms import aggregate

LENGTHS = [8, 3, 5, 1, 6, 2]
N, T = len(LENGTHS), 8
MAX_COMPLETION_LENGTH = 10
"""TRL's `max_completion_length`, a constant >= the padded width T."""


def batch(seed=0, lengths=LENGTHS):
    generator = torch.Generator().manual_seed(seed)
    mask = torch.arange(T).expand(len(lengths), T) < torch.tensor(lengths).unsqueeze(-1)
    per_token = torch.randn(len(lengths), T, generator=generator, dtype=torch.float64).masked_fill(~mask, 100.0)
    return per_token, mask


# TRL 1.16 GRPOTrainer._compute_loss, for one micro-batch before its division by the accumulation
# steps (l: per_token_loss, m: completion_mask as float). `dapo`'s normaliser is
# num_items_in_batch / num_processes (the generation batch's counted tokens, gathered over processes).
def trl_grpo(l, m):
    return ((l * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()


def trl_bnpo(l, m):
    return (l * m).sum() / m.sum().clamp(min=1.0)


def trl_dr_grpo(l, m):
    return (l * m).sum() / (l.size(0) * MAX_COMPLETION_LENGTH)


def trl_dapo(l, m, num_items_in_batch):
    return (l * m).sum() / num_items_in_batch.clamp(min=1.0)


# verl core_algos.agg_loss (dp_size 1, no loss_scale_factor); verl_F.masked_mean adds 1e-8 to the count.
def verl_token_mean(l, m):
    return (l * m).sum() / (m.sum() + 1e-8)


def verl_seq_mean_token_sum(l, m):
    return (l * m).sum(-1).mean()


def verl_seq_mean_token_mean(l, m):
    return ((l * m).sum(-1) / m.sum(-1)).mean()


def verl_seq_mean_token_sum_norm(l, m):
    return (l * m).sum(-1).sum() / m.shape[-1]


# (peer setting, peer's reduction of (l, m), our aggregate arguments) for every row of the table that
# has an exact equivalent.
MAPPED = [
    ("trl grpo", trl_grpo, dict(mode="seq_mean_token_mean")),
    ("trl bnpo", trl_bnpo, dict(mode="token_mean")),
    ("trl dr_grpo", trl_dr_grpo, dict(mode="seq_mean_token_sum_norm", max_length=MAX_COMPLETION_LENGTH)),
    ("trl dapo", lambda l, m: trl_dapo(l, m, m.sum()), dict(mode="token_mean", global_tokens=sum(LENGTHS))),
    ("verl token-mean", verl_token_mean, dict(mode="token_mean")),
    ("verl seq-mean-token-sum", verl_seq_mean_token_sum, dict(mode="seq_mean_token_sum")),
    ("verl seq-mean-token-mean", verl_seq_mean_token_mean, dict(mode="seq_mean_token_mean")),
    # Not our same-named mode alone: verl divides by L only, ours by sequences x L (see below).
    ("verl seq-mean-token-sum-norm", verl_seq_mean_token_sum_norm, dict(mode="seq_mean_token_sum_norm", max_length=T, global_sequences=1)),
]


def values_and_gradients(reduce, per_token):
    leaf = per_token.clone().requires_grad_()
    value = reduce(leaf)
    (gradient,) = torch.autograd.grad(value, leaf)
    return value.detach(), gradient


@pytest.mark.parametrize("peer, peer_reduce, ours", MAPPED, ids=[row[0] for row in MAPPED])
def test_each_mapped_peer_setting_equals_our_aggregate_call(peer, peer_reduce, ours):
    """Same value and same gradient (the weight of every token, padding included) on two random batches."""
    for seed in (0, 1):
        per_token, mask = batch(seed)
        peer_value, peer_gradient = values_and_gradients(lambda l: peer_reduce(l, mask.to(l.dtype)), per_token)
        our_value, our_gradient = values_and_gradients(lambda l: aggregate(l, mask, **ours), per_token)
        assert our_value.item() == pytest.approx(peer_value.item(), rel=1e-9), peer
        assert torch.allclose(our_gradient, peer_gradient, rtol=1e-9, atol=0), peer


def test_the_batch_tells_the_modes_apart():
    """The four modes give four different numbers on this batch, so a wrong mapping cannot pass by accident."""
    per_token, mask = batch()
    values = [
        aggregate(per_token, mask, "token_mean").item(),
        aggregate(per_token, mask, "seq_mean_token_mean").item(),
        aggregate(per_token, mask, "seq_mean_token_sum").item(),
        aggregate(per_token, mask, "seq_mean_token_sum_norm", max_length=T).item(),
    ]
    assert min(abs(a - b) for i, a in enumerate(values) for b in values[i + 1:]) > 1e-3


def test_verl_sum_norm_is_ours_times_the_number_of_sequences():
    """verl's seq-mean-token-sum-norm = sum / L; ours = sum / (N L), as TRL's dr_grpo and as our
    docstring say. So verl's is N = 6 times ours, with the same L (its mask width T = 8)."""
    per_token, mask = batch()
    ours = aggregate(per_token, mask, "seq_mean_token_sum_norm", max_length=T)
    verl = verl_seq_mean_token_sum_norm(per_token, mask.to(per_token.dtype))
    assert verl.item() == pytest.approx(N * ours.item(), rel=1e-12)
    assert verl.item() != pytest.approx(ours.item(), rel=1e-3)
    dr_grpo = trl_dr_grpo(per_token, mask.to(per_token.dtype))
    assert aggregate(per_token, mask, "seq_mean_token_sum_norm", max_length=MAX_COMPLETION_LENGTH).item() == pytest.approx(dr_grpo.item(), rel=1e-12)


MICRO_BATCHES = [slice(0, 3), slice(3, 6)]
"""Two micro-batches of 3 rows: 16 and 9 counted tokens."""


def test_trl_under_gradient_accumulation():
    """TRL divides each micro-batch's grpo, bnpo and dr_grpo loss by the accumulation steps K = 2
    (the accumulated gradient is that of the sum); dapo divides by the whole batch's token count.
    With equal rows per micro-batch, grpo and dr_grpo equal ours with the global sequence count, and
    dapo ours with global_tokens (= the unsplit token mean). bnpo has no global-normaliser
    equivalent: it is the mean of the micro-batches' token means, (S_1/16 + S_2/9) / 2, not the
    batch's (S_1 + S_2) / 25; it is our own-count token_mean per micro-batch, divided by K."""
    per_token, mask = batch()
    m = mask.to(per_token.dtype)
    steps = len(MICRO_BATCHES)

    def accumulated(reduce):
        return sum(reduce(per_token[rows], m[rows], mask[rows]) for rows in MICRO_BATCHES)

    tokens = mask.sum()
    pairs = {
        "grpo": (lambda l, mf, mb: trl_grpo(l, mf) / steps, lambda l, mf, mb: aggregate(l, mb, "seq_mean_token_mean", global_sequences=N)),
        "dr_grpo": (
            lambda l, mf, mb: trl_dr_grpo(l, mf) / steps,
            lambda l, mf, mb: aggregate(l, mb, "seq_mean_token_sum_norm", global_sequences=N, max_length=MAX_COMPLETION_LENGTH),
        ),
        "dapo": (lambda l, mf, mb: trl_dapo(l, mf, tokens), lambda l, mf, mb: aggregate(l, mb, "token_mean", global_tokens=tokens)),
    }
    for name, (trl, ours) in pairs.items():
        assert accumulated(ours).item() == pytest.approx(accumulated(trl).item(), rel=1e-12), name
    assert accumulated(pairs["dapo"][1]).item() == pytest.approx(aggregate(per_token, mask, "token_mean").item(), rel=1e-12)

    bnpo = accumulated(lambda l, mf, mb: trl_bnpo(l, mf) / steps)
    assert bnpo.item() != pytest.approx(aggregate(per_token, mask, "token_mean").item(), rel=1e-3)
    assert bnpo.item() == pytest.approx(accumulated(lambda l, mf, mb: aggregate(l, mb, "token_mean") / steps).item(), rel=1e-12)


def test_a_row_with_no_token_counts_in_trl_grpo_and_ours():
    """A row whose mask is all False (e.g. a response truncated to nothing) adds 0 to the sum and 1
    to the sequence count, in TRL's grpo (mean over rows, token count clamped to 1) and in ours:
    with lengths 8, 3, 0, 5 the result is the mean of three token means divided by 4, not 3."""
    per_token, mask = batch(lengths=[8, 3, 0, 5])
    trl = trl_grpo(per_token, mask.to(per_token.dtype))
    ours = aggregate(per_token, mask, "seq_mean_token_mean")
    assert ours.item() == pytest.approx(trl.item(), rel=1e-12)
    rows = [0, 1, 3]
    three_means = [per_token[i, : [8, 3, 0, 5][i]].mean().item() for i in rows]
    assert ours.item() == pytest.approx(sum(three_means) / 4, rel=1e-12)
