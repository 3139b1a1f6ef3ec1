"""`posttrain explain`: the seed's worked examples, computed by the library's own functions (the
policy-gradient, KL, reward-shaping and distillation examples here, the preference losses' in
`_explain_preference.py`, the shared parts in `_explain_common.py`).

Every number printed here comes out of `posttrain.algorithms` (float64 tensors), not out of
separate arithmetic, so `explain` doubles as a check that the library matches the specification.
"""

from __future__ import annotations

import math

from posttrain.commands._explain_common import _emit, _library_errors_are_user_errors, _probability, _reward, _round, _tensor, _token_grad
from posttrain.commands._explain_preference import explain_dpo, explain_kto, explain_orpo, explain_simpo
from posttrain.errors import UserError

# torch and posttrain.algorithms are imported inside the functions, so that `posttrain --help` and
# the other commands start without torch.


def explain_advantages(args) -> int:
    import torch

    from posttrain.algorithms import group_statistics, grpo_advantages

    rewards = args.rewards
    group_size = args.group_size or len(rewards)
    if group_size < 2:
        raise UserError("a group of one has no relative signal: give at least 2 rewards (--rewards)")
    if len(rewards) % group_size:
        raise UserError(f"--rewards has {len(rewards)} values, not a whole number of groups of {group_size}")
    if args.eps < 0:
        raise UserError(f"--eps must be >= 0, got {args.eps}")
    tensor = _tensor(rewards)
    mean, std, _ = group_statistics(tensor, group_size, unbiased_std=args.unbiased_std)
    advantages = grpo_advantages(tensor, group_size, scale=args.scale, eps=args.eps, unbiased_std=args.unbiased_std)
    one_group = mean.numel() == 1
    result = {
        "mean": mean.item() if one_group else mean.tolist(),
        "std": std.item() if one_group else std.tolist(),
        "advantages": advantages.tolist(),
    }
    std_kind = "sample std (denominator n-1)" if args.unbiased_std else "population std (denominator G)"
    valid = tensor[~torch.isnan(tensor)]
    batch_std = valid.std(correction=1 if args.unbiased_std else 0).item() if valid.numel() > 1 else 0.0
    divisor = {
        "group": "(group std + eps)",
        "batch": f"(batch std {batch_std:.4f} + eps)",
        "none": "1 (Dr. GRPO: no std scaling)",
    }[args.scale]
    lines = [
        f"GRPO group-relative advantages, G = {group_size}, scale = {args.scale}, eps = {args.eps}",
        f"  rewards     {rewards}",
        f"  mean        {_round(mean.tolist())}",
        f"  std         {_round(std.tolist())}   ({std_kind})",
        f"  advantages  {_round(advantages.tolist())}   = (reward - mean) / {divisor}",
        "  Unscorable rewards (nan) are left out of the statistics and get advantage 0.",
        "  An all-equal group gives all-zero advantages: no policy-gradient signal from it.",
    ]
    return _emit(args, result, lines)


def explain_clip(args) -> int:
    from posttrain.algorithms import clipped_surrogate

    old_prob = _probability("--old-prob", args.old_prob)
    new_prob = _probability("--new-prob", args.new_prob)
    logprobs = _tensor([[math.log(new_prob)]])
    old_logprobs = _tensor([[math.log(old_prob)]])
    loss, stats = clipped_surrogate(
        logprobs, old_logprobs, _tensor([args.advantage]), args.clip_low, args.clip_high, args.dual_clip
    )
    clipped = bool(stats["clipped_low"].any() or stats["clipped_high"].any() or stats["dual_clipped"].any())
    ratio, loss_value = stats["ratio"].item(), loss.item()
    result = {"ratio": ratio, "objective": -loss_value, "loss": loss_value, "clipped": clipped}
    lines = [
        "PPO/GRPO clipped surrogate for one token (no KL, not a batch loss)",
        f"  ratio      = exp(log {new_prob} - log {old_prob}) = {ratio:.4f}",
        f"  clip range = [{1 - args.clip_low:.4g}, {1 + args.clip_high:.4g}], advantage {args.advantage:.4f}",
        "  objective  = min(ratio * A, clip(ratio) * A)"
        + (f", at least {args.dual_clip:g} * A for A < 0 (dual clip)" if args.dual_clip else "")
        + f" = {-loss_value:.4f}   (to maximise)",
        f"  loss       = -objective = {loss_value:.4f}",
        f"  clipped    = {clipped}" + ("   (this token gives no gradient)" if clipped else ""),
    ]
    return _emit(args, result, lines)


def explain_kl(args) -> int:
    from posttrain.algorithms import ESTIMATORS, exact_kl, kl_estimate

    policy, reference = args.policy, args.reference
    if len(policy) != len(reference):
        raise UserError(f"--policy has {len(policy)} probabilities but --reference has {len(reference)}")
    for name, dist in (("--policy", policy), ("--reference", reference)):
        for value in dist:
            _probability(name, value)
        if abs(sum(dist) - 1.0) > 1e-6:
            raise UserError(f"{name} must sum to 1 (a distribution over candidate tokens), sums to {sum(dist):.6g}")
    log_p, log_q = _tensor(policy).log(), _tensor(reference).log()
    exact = exact_kl(log_p, log_q).item()
    per_token = {name: kl_estimate(log_p, log_q, name).tolist() for name in ESTIMATORS}
    probabilities = _tensor(policy)
    expected = {name: (probabilities * _tensor(values)).sum().item() for name, values in per_token.items()}
    result = {"exact": exact, "per_token": per_token, "expected": expected}
    lines = [
        f"KL(policy || reference) at one prefix: policy {policy}, reference {reference}",
        f"  exact  sum_v p(v) ln(p(v)/q(v)) = {exact:.4f}",
        "  sampled estimators, value if token v were sampled (r = q/p):",
    ]
    lines += [f"    {name}  {_round(values)}   expectation under the policy {expected[name]:.4f}" for name, values in per_token.items()]
    lines.append("  k1 and k3 are unbiased (their expectation is the exact KL); k3 is never negative; k2 is biased.")
    return _emit(args, result, lines)


def explain_rloo(args) -> int:
    from posttrain.algorithms import rloo_advantages

    rewards = args.rewards
    group_size = args.group_size or len(rewards)
    if group_size < 2 or len(rewards) % group_size:
        raise UserError(f"--rewards: {len(rewards)} values are not whole groups of at least 2 (group size {group_size})")
    advantages = rloo_advantages(_tensor(rewards), group_size).tolist()
    lines = ["RLOO leave-one-out advantages (arXiv:2402.14740 eq. 6): A_i = r_i - mean of the others in its group",
             f"  rewards    {rewards}", f"  advantages {_round(advantages)}"]
    return _emit(args, {"advantages": advantages}, lines)


def explain_reinforce(args) -> int:
    import torch

    from posttrain.algorithms.advantages import reinforce_returns
    from posttrain.algorithms.kl import kl_in_reward

    kl = _tensor([args.kl])
    mask = torch.ones_like(kl, dtype=torch.bool)
    returns = reinforce_returns(kl_in_reward(_tensor([args.reward]), kl, mask, args.beta, per_token=True), mask)[0].tolist()
    lines = ["REINFORCE++ returns before whitening (arXiv:2501.03262): G_t = R - beta * sum_{i >= t} KL_i",
             f"  R {args.reward}, beta {args.beta}, KL {args.kl}", f"  returns {_round(returns)}"]
    return _emit(args, {"returns": returns}, lines)


def explain_distill(args) -> int:
    import torch

    from posttrain.algorithms.distill import reverse_kl_per_token, teacher_token_rewards
    from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards

    if len(args.teacher) != len(args.student):
        raise UserError(f"--teacher and --student need one log-prob per token each, got {len(args.teacher)} and {len(args.student)}")
    if any(value > 0 for value in args.teacher + args.student):
        raise UserError("--teacher and --student are log-probabilities: each must be <= 0")
    if not 0 <= args.discount <= 1:
        raise UserError(f"--discount must be in [0, 1], got {args.discount}")
    teacher, student = _tensor([args.teacher]), _tensor([args.student])
    mask = torch.ones_like(teacher, dtype=torch.bool)
    rewards = teacher_token_rewards(teacher, student, mask, args.weight).double()
    inputs = StepRewards(rewards=_tensor([0.0]), mask=mask, sampled=mask, group_size=1, token_rewards=rewards)
    advantages = ADVANTAGE_ESTIMATORS["distill"].estimate(inputs, discount=args.discount, baseline="none").advantages[0].tolist()
    kl = float(reverse_kl_per_token(teacher, student, mask))
    result = {"token_rewards": rewards[0].tolist(), "sequence_sum": float(rewards.sum()), "reverse_kl_per_token": kl,
              "advantages": advantages}
    lines = ["On-policy distillation (teacher:MODEL): each sampled token's reward r_t = weight x (log p_teacher - log p_student)",
             f"  log p_teacher {args.teacher}", f"  log p_student {args.student}, weight {args.weight:g}",
             f"  token rewards r_t               = {_round(result['token_rewards'])}",
             f"  reverse KL estimate per token   = {kl:.4f}   (mean of log p_student - log p_teacher)",
             f"  loss.advantage distill, discount {args.discount:g}: A_t = {_round(advantages)}",
             f"  group / rloo / reinforce_pp sum the row's tokens into its reward first: {result['sequence_sum']:.4f}"]
    return _emit(args, result, lines)


def explain_gspo(args) -> int:
    from posttrain.algorithms.policy import sequence_clipped_surrogate

    log_ratios = _tensor([args.log_ratios])
    old = log_ratios * 0
    loss, grad, stats = _token_grad(lambda lp: sequence_clipped_surrogate(
        lp, old, _tensor([args.advantage]), old == 0, args.clip_low, args.clip_high), log_ratios, "seq_mean_token_mean")
    ratio = stats["ratio"][0, 0].item()
    clipped = bool(stats["clipped_low"].any() or stats["clipped_high"].any())
    lines = ["GSPO sequence-level clipped surrogate (arXiv:2507.18071 section 4), one sequence",
             f"  s = exp(mean log-ratio {args.log_ratios}) = {ratio:.6f}, clip range [{1 - args.clip_low:.6g}, {1 + args.clip_high:.6g}]",
             f"  loss = {loss:.6f}; d loss / d log pi_t = {_round(grad, 6)}" + ("   (clipped: no gradient)" if clipped else "")]
    return _emit(args, {"ratio": ratio, "loss": loss, "grad": grad, "clipped": clipped}, lines)


def explain_cispo(args) -> int:
    from posttrain.algorithms.policy import cispo_surrogate

    if not 0 <= args.min < args.max:
        raise UserError(f"--min and --max must satisfy 0 <= min < max, got {args.min}, {args.max}")
    logprob = _tensor([[math.log(args.ratio)]])
    loss, grad, stats = _token_grad(lambda lp: cispo_surrogate(lp, lp.detach() * 0, _tensor([args.advantage]), args.min, args.max), logprob)
    lines = ["CISPO for one token (arXiv:2506.13585 section 3.1): -sg(clip(r, min, max)) * A * log pi",
             f"  r {args.ratio}, A {args.advantage}, bounds [{args.min:g}, {args.max:g}] (absolute)",
             f"  loss = {loss:.6f} (at log pi = log r); d loss / d log pi = {grad[0]:.6f}"]
    return _emit(args, {"loss": loss, "grad": grad[0], "clipped": bool(stats["clipped_high"].any() or stats["clipped_low"].any())}, lines)


def explain_decoupled(args) -> int:
    import torch

    from posttrain.algorithms import clipped_surrogate, importance_weights

    columns = (args.logprob, args.proximal, args.behaviour)
    if len({len(column) for column in columns}) != 1:
        raise UserError(f"--logprob, --proximal and --behaviour need one value per token each, got {', '.join(str(len(c)) for c in columns)}")
    if not 0 <= args.clip < 1 or args.cap <= 0 or not 0 <= args.lower < args.upper:
        raise UserError(f"need 0 <= --clip < 1, --cap > 0 and 0 <= --lower < --upper, got {args.clip}, {args.cap}, {args.lower}, {args.upper}")
    logprobs, proximal, behaviour = (_tensor([column]) for column in columns)
    advantage, mask = _tensor([args.advantage]), torch.ones_like(proximal, dtype=torch.bool)
    rule = {"level": args.level, "mode": args.mode, "cap": args.cap, "lower": args.lower, "upper": args.upper}
    correction = importance_weights(proximal, behaviour, mask, **rule)

    def decoupled(lp):
        per_token, stats = clipped_surrogate(lp, proximal, advantage, args.clip, args.clip)
        return per_token * correction.weights, stats

    loss, grad, stats = _token_grad(decoupled, logprobs)
    stale_loss, stale_grad, stale_stats = _token_grad(lambda lp: clipped_surrogate(lp, behaviour, advantage, args.clip, args.clip), logprobs)
    ratio, weights, raw = stats["ratio"][0].tolist(), correction.weights[0].tolist(), correction.raw[0].tolist()
    clipped_term = (-clipped_surrogate(logprobs, proximal, advantage, args.clip, args.clip)[0])[0].tolist()  # before the weight
    band = f"truncated at {args.cap:g}" if args.mode == "truncate" else f"0 outside [{args.lower:g}, {args.upper:g}]"
    result = {"ratio": ratio, "clipped_term": clipped_term, "weight": weights, "raw_weight": raw, "loss": loss, "grad": grad,
              "behaviour_ratio": stale_stats["ratio"][0].tolist(), "behaviour_loss": stale_loss, "behaviour_grad": stale_grad}
    lines = [
        "Decoupled PPO (Hilton et al. arXiv:2110.00641; AReaL arXiv:2505.24298) on one sequence of a stale batch:",
        "  loss_t = -w_t min(r_t A, clip(r_t, 1 - eps, 1 + eps) A),  r_t = pi / pi_prox,  w_t = sg(pi_prox / pi_behav)",
        f"  log pi {args.logprob}, log pi_prox {args.proximal}, log pi_behav {args.behaviour}, A {args.advantage}, eps {args.clip}",
        f"  ratio to proximal r  = {_round(ratio, 6)}",
        f"  clipped term         = {_round(clipped_term, 6)}   = min(r A, clip(r) A)",
        f"  weight w             = {_round(weights, 6)}   (pi_prox / pi_behav {_round(raw, 6)}, level {args.level}, {band})",
        f"  loss = {loss:.6f} (summed over tokens); d loss / d log pi_t = {_round(grad, 6)}",
        f"  PPO against the behaviour policy instead: ratio {_round(result['behaviour_ratio'], 6)}, loss {stale_loss:.6f}, "
        f"d loss / d log pi_t = {_round(stale_grad, 6)}",
        "  (there the clip sees staleness and trust region as one ratio: a stale token can be clipped before the policy moved)",
    ]
    return _emit(args, result, lines)


def explain_overlong(args) -> int:
    from posttrain.algorithms.overlong import overlong_shaping
    from posttrain.rewards.overlong import FORMULA

    shaping = overlong_shaping(_tensor(args.lengths), args.max_tokens, args.buffer, args.penalty).tolist()
    start = args.max_tokens - args.buffer
    lines = [f"DAPO soft overlong punishment (arXiv:2503.14476 eq. 13), reward_options.overlong: max_tokens {args.max_tokens}, "
             f"buffer {args.buffer}, penalty {args.penalty:g}",
             f"  {FORMULA}",
             f"  L counts the policy's own tokens; the ramp runs over L in ({start}, {args.max_tokens}]"]
    lines += [f"  L = {length:g}: shaping {value:+.4f}" for length, value in zip(args.lengths, shaping)]
    lines.append("  Added to ok rewards only (after reward_options.truncated); an unscorable row stays unscored.")
    return _emit(args, {"lengths": args.lengths, "shaping": shaping}, lines)
def explain_kl_cov(args) -> int:
    import torch

    from posttrain.algorithms.covariance import kl_cov_surrogate, token_covariance

    columns = (args.logprob, args.old, args.advantages)
    if len({len(column) for column in columns}) != 1:
        raise UserError(f"--logprob, --old and --advantages need one value per token each, got {', '.join(str(len(c)) for c in columns)}")
    if not 0 < args.fraction <= 1 or args.coef < 0:
        raise UserError(f"need 0 < --fraction <= 1 and --coef >= 0, got {args.fraction}, {args.coef}")
    logprobs, old, advantages = (_tensor([column]) for column in columns)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    loss, grad, stats = _token_grad(lambda lp: kl_cov_surrogate(lp, old, advantages, mask, args.fraction, args.coef), logprobs)
    covariance = token_covariance(logprobs, advantages, mask)[0].tolist()
    penalised = stats["cov_penalised"][0].tolist()
    lines = ["KL-Cov on one sequence (arXiv:2505.22617): loss_t = -r_t A_t + coef |log r_t| on the top fraction of tokens by covariance",
             f"  log pi {args.logprob}, log pi_old {args.old}, A {args.advantages}, fraction {args.fraction:g}, coef {args.coef:g}",
             f"  cov_t = (A_t - mean A)(log pi_t - mean log pi) = {_round(covariance, 6)}",
             f"  penalised (top max(1, floor(fraction x {len(args.logprob)}))) = {penalised}",
             f"  loss = {loss:.6f} (summed over tokens); d loss / d log pi_t = {_round(grad, 6)}"]
    return _emit(args, {"covariance": covariance, "penalised": penalised, "loss": loss, "grad": grad}, lines)


def explain_entropy(args) -> int:
    import torch

    from posttrain.algorithms.logprobs import entropy

    if len(args.logits) < 2:
        raise UserError(f"--logits needs at least 2 values (a distribution over candidates), got {len(args.logits)}")
    if args.coef < 0:
        raise UserError(f"--coef must be >= 0 (loss.entropy.coef is a bonus), got {args.coef}")
    logits = _tensor(args.logits).requires_grad_(True)
    value = entropy(logits, args.temperature)
    (grad,) = torch.autograd.grad(value, logits)  # through the library's own entropy, as the loss step differentiates it
    probabilities = torch.softmax(logits.detach() / args.temperature, dim=-1)
    analytic = -probabilities * (probabilities.log() + value.detach()) / args.temperature
    result = {"probabilities": probabilities.tolist(), "entropy": value.item(), "grad": grad.tolist(),
              "analytic_grad": analytic.tolist(), "bonus": -args.coef * value.item(), "bonus_grad": (-args.coef * grad).tolist()}
    lines = [
        f"Entropy bonus at one position (loss.entropy.coef {args.coef:g}): logits {args.logits}, temperature {args.temperature:g}",
        f"  p = softmax(logits / T)            = {_round(result['probabilities'], 6)}",
        f"  H = -sum_v p_v log p_v             = {value.item():.6f}   (max log {len(args.logits)} = {math.log(len(args.logits)):.6f})",
        f"  dH/dlogits (autograd)              = {_round(result['grad'], 6)}",
        f"  -p_v (log p_v + H) / T (analytic)  = {_round(result['analytic_grad'], 6)}",
        f"  this token's loss term -coef H     = {result['bonus']:.6f}; its gradient -coef dH/dlogits = {_round(result['bonus_grad'], 6)}",
        "  A step down that gradient raises the rarer candidates' logits and lowers the likeliest's: the entropy rises.",
    ]
    return _emit(args, result, lines)


def register(subparsers) -> None:
    subparsers.add_parser("explain", help="worked examples of the training math (advantages, clipping, DPO-family, KL, ...), "
                                          "computed by the library", deferred=add_examples)


def add_examples(parser) -> None:
    """The examples, each a subcommand; added when `explain` is parsed or its --help shown (the
    loss names come from the objective table, which imports torch)."""
    from posttrain.algorithms.importance import IMPORTANCE_LEVELS, IMPORTANCE_MODES
    from posttrain.losses.objectives import PREFERENCE_OBJECTIVES
    from posttrain.losses.policy_gradient_config import OffPolicy

    commands = parser.add_subparsers(dest="example", metavar="EXAMPLE", required=True, parser_class=type(parser))

    advantages = commands.add_parser("advantages", help="GRPO group-relative advantages")
    advantages.add_argument("--rewards", type=_reward, nargs="+", required=True, help="rewards; nan = unscorable")
    advantages.add_argument("--group-size", type=int, default=None, help="G (default: all rewards are one group)")
    advantages.add_argument("--scale", choices=["group", "batch", "none"], default="group")
    advantages.add_argument("--eps", type=float, default=0.0, help="added to the std (default 0: the formula as written)")
    advantages.add_argument("--unbiased-std", action="store_true", help="divide the variance by n-1, not G")
    advantages.set_defaults(func=_library_errors_are_user_errors(explain_advantages))

    clip = commands.add_parser("clip", help="clipped ratio objective for one token")
    clip.add_argument("--old-prob", type=float, required=True)
    clip.add_argument("--new-prob", type=float, required=True)
    clip.add_argument("--advantage", type=float, required=True)
    clip.add_argument("--clip-low", type=float, default=0.2)
    clip.add_argument("--clip-high", type=float, default=0.2)
    clip.add_argument("--dual-clip", type=float, default=None, help="c > 1 bounds negative-advantage losses")
    clip.set_defaults(func=_library_errors_are_user_errors(explain_clip))

    dpo = commands.add_parser("dpo", help="DPO-family loss for one preference pair")
    for flag in ("--chosen", "--rejected", "--ref-chosen", "--ref-rejected"):
        dpo.add_argument(flag, type=float, required=True, help="sequence log-prob (sum over response tokens)")
    dpo.add_argument("--beta", type=float, default=0.1)
    dpo.add_argument("--loss", choices=sorted(name for name, entry in PREFERENCE_OBJECTIVES.items() if entry.pair_loss is not None),
                     default="sigmoid")
    dpo.add_argument("--label-smoothing", type=float, default=None, help="label noise rate (default: the loss's own)")
    dpo.add_argument("--chosen-length", type=float, default=None, help="response tokens of the chosen answer (length_normalized)")
    dpo.add_argument("--rejected-length", type=float, default=None, help="response tokens of the rejected answer (length_normalized)")
    dpo.set_defaults(func=_library_errors_are_user_errors(explain_dpo))

    kl = commands.add_parser("kl", help="exact KL vs the k1/k2/k3 estimators at one prefix")
    kl.add_argument("--policy", type=float, nargs="+", required=True, help="policy probabilities of the candidates")
    kl.add_argument("--reference", type=float, nargs="+", required=True, help="reference probabilities")
    kl.set_defaults(func=_library_errors_are_user_errors(explain_kl))

    rloo = commands.add_parser("rloo", help="RLOO leave-one-out advantages")
    rloo.add_argument("--rewards", type=_reward, nargs="+", required=True, help="rewards; nan = unscorable")
    rloo.add_argument("--group-size", type=int, default=None, help="G (default: all rewards are one group)")
    rloo.set_defaults(func=_library_errors_are_user_errors(explain_rloo))

    reinforce = commands.add_parser("reinforce", help="REINFORCE++ per-token returns of one sequence")
    reinforce.add_argument("--reward", type=float, required=True, help="the sequence reward R")
    reinforce.add_argument("--kl", type=float, nargs="+", required=True, help="per-token KL estimates")
    reinforce.add_argument("--beta", type=float, required=True)
    reinforce.set_defaults(func=_library_errors_are_user_errors(explain_reinforce))

    gspo = commands.add_parser("gspo", help="GSPO sequence-ratio surrogate of one sequence, with its gradient")
    gspo.add_argument("--log-ratios", type=float, nargs="+", required=True, help="log pi - log pi_old of each token")
    gspo.add_argument("--advantage", type=float, required=True)
    gspo.add_argument("--clip-low", type=float, default=3e-4)
    gspo.add_argument("--clip-high", type=float, default=4e-4)
    gspo.set_defaults(func=_library_errors_are_user_errors(explain_gspo))

    cispo = commands.add_parser("cispo", help="CISPO for one token, with its gradient")
    cispo.add_argument("--ratio", type=float, required=True, help="pi / pi_old of the token")
    cispo.add_argument("--advantage", type=float, required=True)
    cispo.add_argument("--min", type=float, default=0.0, help="absolute lower bound of the weight")
    cispo.add_argument("--max", type=float, default=5.0, help="absolute upper bound of the weight")
    cispo.set_defaults(func=_library_errors_are_user_errors(explain_cispo))

    rule = OffPolicy()  # the defaults of loss.off_policy
    decoupled = commands.add_parser("decoupled", help="the decoupled PPO objective on a stale batch, with its weight and gradient")
    decoupled.add_argument("--logprob", type=float, nargs="+", required=True, help="log pi of each token under the policy being trained")
    decoupled.add_argument("--proximal", type=float, nargs="+", required=True, help="log pi_prox: the weights at the start of this step")
    decoupled.add_argument("--behaviour", type=float, nargs="+", required=True, help="log pi_behav: the policy that sampled the tokens")
    decoupled.add_argument("--advantage", type=float, required=True)
    decoupled.add_argument("--clip", type=float, default=0.2, help="eps: the ratio to the proximal policy is clipped to [1 - eps, 1 + eps]")
    decoupled.add_argument("--level", choices=IMPORTANCE_LEVELS, default=rule.level)
    decoupled.add_argument("--mode", choices=IMPORTANCE_MODES, default=rule.mode)
    decoupled.add_argument("--cap", type=float, default=rule.cap, help="mode truncate: w is min(w, cap)")
    decoupled.add_argument("--lower", type=float, default=rule.lower, help="mode mask: w below is 0")
    decoupled.add_argument("--upper", type=float, default=rule.upper, help="mode mask: w above is 0")
    decoupled.set_defaults(func=_library_errors_are_user_errors(explain_decoupled))

    entropy = commands.add_parser("entropy", help="the entropy bonus at one position: p, H and its gradient")
    entropy.add_argument("--logits", type=float, nargs="+", default=[1.0, 0.0, -1.0], help="logits of the candidates")
    entropy.add_argument("--coef", type=float, default=0.01, help="loss.entropy.coef")
    entropy.add_argument("--temperature", type=float, default=1.0, help="the sampling temperature T")
    entropy.set_defaults(func=_library_errors_are_user_errors(explain_entropy))

    kl_cov = commands.add_parser("kl_cov", help="KL-Cov on one sequence: covariances, the penalised tokens, loss and gradient")
    kl_cov.add_argument("--logprob", type=float, nargs="+", required=True, help="log pi of each token")
    kl_cov.add_argument("--old", type=float, nargs="+", required=True, help="log pi_old of each token")
    kl_cov.add_argument("--advantages", type=float, nargs="+", required=True, help="A of each token")
    kl_cov.add_argument("--fraction", type=float, default=2e-4, help="loss.kl_cov.fraction (at least one token)")
    kl_cov.add_argument("--coef", type=float, default=1.0, help="loss.kl_cov.coef")
    kl_cov.set_defaults(func=_library_errors_are_user_errors(explain_kl_cov))

    simpo = commands.add_parser("simpo", help="SimPO loss of one pair (no reference)")
    orpo = commands.add_parser("orpo", help="ORPO loss of one pair (no reference)")
    for sub in (simpo, orpo):
        sub.add_argument("--chosen-mean", type=float, required=True, help="the chosen answer's mean token log-prob")
        sub.add_argument("--rejected-mean", type=float, required=True, help="the rejected answer's mean token log-prob")
    simpo.add_argument("--beta", type=float, default=2.5)
    simpo.add_argument("--gamma", type=float, default=1.375, help="the absolute target margin (TRL's simpo_gamma)")
    simpo.set_defaults(func=_library_errors_are_user_errors(explain_simpo))
    orpo.add_argument("--lam", type=float, default=0.1, help="lambda, the odds-ratio term's weight (TRL's beta)")
    orpo.set_defaults(func=_library_errors_are_user_errors(explain_orpo))

    kto = commands.add_parser("kto", help="KTO loss of one labelled completion")
    kto.add_argument("--log-ratio", type=float, required=True, help="log pi - log pi_ref of the completion")
    kto.add_argument("--mismatched", type=float, nargs="+", required=True, help="log-ratios of mismatched prompt/completion pairs")
    kto.add_argument("--beta", type=float, default=0.1)
    kto.add_argument("--label", choices=["desirable", "undesirable"], required=True)
    kto.set_defaults(func=_library_errors_are_user_errors(explain_kto))

    distill = commands.add_parser("distill", help="the teacher's per-token reward (on-policy distillation) and its advantages")
    distill.add_argument("--teacher", type=float, nargs="+", default=[-0.5, -1.0, -0.2], help="the teacher's log-prob of each sampled token")
    distill.add_argument("--student", type=float, nargs="+", default=[-0.7, -0.4, -0.2], help="the student's log-prob of each sampled token")
    distill.add_argument("--weight", type=float, default=1.0, help="the teacher's weight in the reward (0.5*teacher:DIR -> 0.5)")
    distill.add_argument("--discount", type=float, default=0.0, help="loss.distill.discount")
    distill.set_defaults(func=_library_errors_are_user_errors(explain_distill))

    overlong = commands.add_parser("overlong", help="DAPO's soft overlong punishment of completion lengths")
    overlong.add_argument("--max-tokens", type=int, default=20, help="L_max: past it the shaping is -penalty")
    overlong.add_argument("--buffer", type=int, default=4, help="L_cache: the ramp's width, ending at max_tokens")
    overlong.add_argument("--penalty", type=float, default=1.0)
    overlong.add_argument("--lengths", type=int, nargs="+", default=[15, 18, 25],
                          help="completion lengths in policy tokens (default: before, inside and past the ramp)")
    overlong.set_defaults(func=_library_errors_are_user_errors(explain_overlong))

    for sub in (advantages, clip, dpo, kl, rloo, reinforce, gspo, cispo, decoupled, entropy, kl_cov, simpo, orpo, kto, overlong, distill):
        sub.add_argument("--json", action="store_true", help="print one JSON object")
