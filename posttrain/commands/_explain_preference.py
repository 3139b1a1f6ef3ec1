"""`posttrain explain`'s preference-loss examples (DPO and its family, SimPO, ORPO, KTO): one pair's
loss, margin and gradient, computed by the library's own functions."""

from __future__ import annotations

from posttrain.commands._explain_common import _emit, _pair_loss, _tensor
from posttrain.errors import UserError


def explain_dpo(args) -> int:
    from posttrain.losses.objectives import PREFERENCE_OBJECTIVES

    if args.beta <= 0:
        raise UserError(f"--beta must be > 0, got {args.beta}")
    entry = PREFERENCE_OBJECTIVES[args.loss]
    loss_fn = entry.pair_loss
    if args.label_smoothing is not None and entry.label_smoothing == "refused":
        raise UserError(f"--label-smoothing does not apply to --loss {args.loss}")
    lengths = (args.chosen_length, args.rejected_length)
    if entry.length_normalized and None in lengths:
        raise UserError(f"--loss {args.loss} needs --chosen-length and --rejected-length (response tokens)")
    # None keeps each loss's own default (0 for sigmoid, 0.1 for conservative and robust).
    extra = {"label_smoothing": args.label_smoothing} if args.label_smoothing is not None else {}
    losses, chosen_reward, rejected_reward = loss_fn(
        _tensor([args.chosen]), _tensor([args.rejected]), _tensor([args.ref_chosen]), _tensor([args.ref_rejected]),
        *(_tensor([length]) if length is not None else None for length in lengths), beta=args.beta, **extra,
    )
    logit = (chosen_reward - rejected_reward).item()
    result = {
        "logit": logit,
        "loss": losses.item(),
        "chosen_reward": chosen_reward.item(),
        "rejected_reward": rejected_reward.item(),
    }
    gap = (args.chosen - args.ref_chosen) - (args.rejected - args.ref_rejected)
    lines = [
        f"DPO-family loss '{args.loss}' for one preference pair, beta = {args.beta}",
        f"  relative gap h = ({args.chosen} - {args.ref_chosen}) - ({args.rejected} - {args.ref_rejected}) = {gap:g}",
        f"  logit  beta*h  = {logit:.4f}",
        f"  loss           = {losses.item():.4f}" + ("   = log(1 + exp(-beta*h))" if args.loss == "sigmoid" and not args.label_smoothing else ""),
        f"  implicit rewards: chosen {chosen_reward.item():.4f}, rejected {rejected_reward.item():.4f}",
        "  If the policy equals the reference, h = 0 and the sigmoid loss is ln 2 ~ 0.6931.",
    ]
    return _emit(args, result, lines)


def explain_simpo(args) -> int:
    from posttrain.algorithms import simpo_loss

    loss, grad = _pair_loss(simpo_loss, args.chosen_mean, args.rejected_mean, beta=args.beta, gamma=args.gamma)
    margin = args.beta * (args.chosen_mean - args.rejected_mean) - args.gamma
    lines = ["SimPO for one pair (arXiv:2405.14734 eq. 6), no reference: -log sigmoid(beta m_c - beta m_r - gamma)",
             f"  mean log-probs chosen {args.chosen_mean}, rejected {args.rejected_mean}; beta {args.beta}, gamma {args.gamma} "
             f"(absolute; gamma/beta = {args.gamma / args.beta:.4g})",
             f"  margin = {margin:.6f}, loss = {loss:.6f}; d loss / d m_c = {grad[0]:.6f}"]
    return _emit(args, {"loss": loss, "grad": grad[0], "margin": margin}, lines)


def explain_orpo(args) -> int:
    from posttrain.algorithms import orpo_loss

    loss, grad = _pair_loss(orpo_loss, args.chosen_mean, args.rejected_mean, lam=args.lam)
    total = loss - args.chosen_mean  # the SFT term: the chosen's token-mean NLL
    lines = ["ORPO for one pair (arXiv:2403.07691 eqs. 6-7), no reference: NLL(chosen) + lambda * -log sigmoid(log odds_c - log odds_r)",
             f"  mean log-probs chosen {args.chosen_mean}, rejected {args.rejected_mean}; lambda {args.lam}",
             f"  lambda * L_OR = {loss:.6f}; with the chosen NLL {-args.chosen_mean:.6f}: {total:.6f}"]
    return _emit(args, {"loss": total, "odds_ratio_term": loss, "grad": grad[0] - 1.0}, lines)


def explain_kto(args) -> int:
    import torch

    from posttrain.algorithms import kto_loss

    log_ratio = _tensor([args.log_ratio]).requires_grad_(True)
    losses, _, reference_point = kto_loss(log_ratio, _tensor(args.mismatched), torch.tensor([args.label == "desirable"]),
                                          beta=args.beta)
    losses.sum().backward()
    lines = [f"KTO for one {args.label} completion (arXiv:2402.01306), reference point z0 = max(0, mean of the mismatched log-ratios)",
             f"  log-ratio {args.log_ratio}, mismatched {args.mismatched} -> z0 {reference_point.item():.6f}, beta {args.beta}",
             f"  loss = {losses.item():.6f}; d loss / d log-ratio = {log_ratio.grad.item():.6f}"]
    return _emit(args, {"loss": losses.item(), "grad": log_ratio.grad.item(), "reference_point": reference_point.item()}, lines)
