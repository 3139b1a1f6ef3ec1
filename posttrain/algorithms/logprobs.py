"""Log-probs of target tokens from logits, without materialising a full (N, T, V) log-softmax.

log p(x) = logit(x) / tau - logsumexp(logits / tau). Computing that over chunks of positions keeps
one chunk's (chunk, V) temporaries alive instead of a whole log-softmax tensor; logsumexp's backward
recomputes the softmax per chunk from the logits autograd already holds. The temperature tau must be
the one the samples were drawn at (docs/rollout.md, "Which log-probs are which").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Log-prob of each target token under softmax(logits / temperature).

    Args:
        logits: (..., V), aligned with `targets` (logits[..., t, :] scores targets[..., t]).
        targets: (...) long token ids.
        temperature: > 0; the sampling temperature.
        chunk_size: positions per chunk (bounds peak memory to about chunk_size * V floats).

    Returns:
        (...) float32 log-probs (float64 if the logits are float64), differentiable w.r.t. logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not align with targets {tuple(targets.shape)}")
    vocab = logits.shape[-1]
    flat_logits, flat_targets = logits.reshape(-1, vocab), targets.reshape(-1)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        chunk = flat_logits[start : start + chunk_size].to(dtype)  # (chunk, V)
        if temperature != 1.0:  # x / 1.0 is x: skip the (chunk, V) copy and its gradient's
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_targets[start : start + chunk_size, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return flat_logits.new_zeros(targets.shape, dtype=dtype)
    return torch.cat(pieces).reshape(targets.shape)


class _HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T + bias)[target], chunk by chunk; backward recomputes each chunk's
    logits instead of keeping them (the LM-head half of a "fused linear cross-entropy").

    The matmuls run in the dtype they would outside this function: under autocast (bf16-mixed) in
    the autocast dtype, the backward too (it runs outside autocast, so it casts explicitly); the
    log-softmax is float32 either way."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size):
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        kind = hidden.device.type
        compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.promote_types(hidden.dtype, weight.dtype)
        out = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        lse = torch.empty_like(out)
        with torch.autocast(kind, enabled=False):
            w, b = weight.to(compute), None if bias is None else bias.to(compute)
            for start in range(0, hidden.shape[0], chunk_size):
                logits = F.linear(hidden[start:start + chunk_size].to(compute), w, b).to(dtype)  # (chunk, V)
                lse[start:start + chunk_size] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(-1, targets[start:start + chunk_size, None]).squeeze(-1)
                out[start:start + chunk_size] = picked - lse[start:start + chunk_size]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.compute = chunk_size, compute
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute = ctx.compute
        w, b = weight.to(compute), None if bias is None else bias.to(compute)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        same = hidden.dtype == weight.dtype == compute  # fp32 (or plain bf16): the original in-place kernels
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            h, g = hidden[rows].to(compute), grad_out[rows].to(lse.dtype)
            # d out_k / d logits_kv = [v == target_k] - softmax_kv
            grad_logits = F.linear(h, w, b).to(lse.dtype).sub_(lse[rows, None]).exp_().mul_(-g[:, None])
            grad_logits.scatter_add_(-1, targets[rows, None], g[:, None])
            grad_logits = grad_logits.to(compute)
            if same:
                if need_hidden:
                    torch.matmul(grad_logits, w, out=grad_hidden[rows])
                if need_weight:
                    grad_weight.addmm_(grad_logits.T, h)
            else:
                if need_hidden:
                    grad_hidden[rows] = grad_logits @ w
                if need_weight:
                    grad_weight += grad_logits.T @ h
            if need_bias:
                grad_bias += grad_logits.sum(0)
        return grad_hidden, grad_weight, grad_bias, None, None


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, chunk_size: int = 256) -> torch.Tensor:
    """Log-probs of ``targets`` under ``softmax(head(hidden))`` without keeping any (K, V) logits.

    Equal to ``token_logprobs(head(hidden), targets)``, but the logits exist one chunk at a time,
    in the forward and again (recomputed) in the backward: K x V saved logits (and as many gradient
    values) that a training step no longer holds at its peak (sizes in docs/models.md). The price is
    one more LM-head matmul in backward.

    Args:
        hidden: (K, H) final hidden states at the positions that predict ``targets``.
        head: the model's output embedding, a plain ``nn.Linear`` (V, H) (bias optional).
        targets: (K,) long token ids.
        chunk_size: positions per chunk; a chunk's temporaries are ~2 * chunk_size * V floats.

    Returns:
        (K,) float32 log-probs (float64 for float64 inputs), differentiable w.r.t. ``hidden`` and the
        head's weight and bias.
    """
    if hidden.shape[:-1] != targets.shape or hidden.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be (K, H) with targets (K,), got {tuple(targets.shape)}")
    return _HeadLogprobs.apply(hidden, head.weight, head.bias, targets, chunk_size)


def response_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs of a causal LM over a full sequence, shifted and masked.

    Position t's logits predict token t + 1, so the result is aligned with `input_ids[:, 1:]`.

    Args:
        logits: (N, L, V) from model(input_ids).
        input_ids: (N, L) prompt + response (+ padding).
        mask: (N, L) bool, True = response token (incl. its ending EOS), aligned with input_ids.
        temperature, chunk_size: as in `token_logprobs`.

    Returns:
        logprobs (N, L - 1) with 0 where the shifted mask is False, and that mask (N, L - 1).
    """
    targets = input_ids[:, 1:]
    shifted_mask = mask[:, 1:]
    logprobs = token_logprobs(logits[:, :-1], targets, temperature, chunk_size)
    return logprobs.masked_fill(~shifted_mask, 0.0), shifted_mask


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence log-prob: the sum of the response tokens' log-probs (the seed's DPO convention).

    Args:
        logprobs: (N, T) per-token log-probs.
        mask: (N, T) bool, True = response token (prompt and padding False, ending EOS True).

    Returns:
        (N,) sums.
    """
    return (logprobs * mask.to(logprobs.dtype)).sum(dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(...,) entropy H = -sum_v p(v) log p(v) of softmax(logits / temperature) at each position,
    in float32 and detached (a metric, never a loss term here).

    Args:
        logits: (..., V) logits, e.g. (n, T, V).
    """
    with torch.no_grad():
        log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
        return -(log_p.exp() * log_p).sum(-1)


class _Entropy(torch.autograd.Function):
    """H(softmax(z)) per position, z = logits / tau, chunk by chunk; backward recomputes each chunk's
    softmax from the logits instead of keeping (n, T, V) probabilities alive:
    dH/dz_v = -p_v (log p_v + H), so dH/dlogits_v = -p_v (log p_v + H) / tau."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        flat = logits.reshape(-1, logits.shape[-1])
        out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
        for start in range(0, flat.shape[0], chunk_size):
            log_p = torch.log_softmax(flat[start:start + chunk_size].to(dtype) / temperature, dim=-1)  # (chunk, V)
            out[start:start + chunk_size] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out):
        logits, entropy = ctx.saved_tensors
        flat, grad_flat = logits.reshape(-1, logits.shape[-1]), grad_out.reshape(-1).to(entropy.dtype)
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            log_p = torch.log_softmax(flat[rows].to(entropy.dtype) / ctx.temperature, dim=-1)  # (chunk, V)
            dz = -log_p.exp() * (log_p + entropy[rows, None])
            grad[rows] = (dz * (grad_flat[rows, None] / ctx.temperature)).to(flat.dtype)
        return grad.reshape(logits.shape), None, None


def entropy(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy H = -sum_v p(v) log p(v) of softmax(logits / temperature) at each position, WITH
    gradient (the entropy bonus's term: Mnih et al. arXiv:1602.01783 eq. 5's beta H; Schulman et al.
    arXiv:1707.06347 eq. 9's c2 S). Equal in value to `token_entropy`; no (..., V) probabilities are
    kept for the backward, which recomputes them chunk by chunk from the logits autograd holds anyway.

    Args:
        logits: (..., V), e.g. (n, T, V).
        temperature: > 0, the sampling temperature (the same distribution the log-probs are taken under).
        chunk_size: positions per chunk (bounds the temporaries to about chunk_size * V floats).

    Returns:
        (...) float32 entropies (float64 for float64 logits), differentiable w.r.t. the logits:
        dH/dlogits_v = -p_v (log p_v + H) / temperature.

    Example: logits [1, 0, -1] -> p = [0.665241, 0.244728, 0.090031], H = 0.832396,
    dH/dlogits = [-0.282587, 0.140770, 0.141817] (`posttrain explain entropy`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _Entropy.apply(logits, temperature, chunk_size)


def _float_type(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _head_pass(hidden, weight, bias, targets, temperature, chunk_size, probs=None, entropy=True):
    """The forward of `head_scores`, chunk by chunk: (K,) log-probs, (K,) entropies (None when not
    `entropy` and no `probs`) and the matmuls' dtype; fills `probs` (K, V) when given. The one loop
    both the training forward and a no-grad forward of the same rows run, so their log-probs agree
    to the bit."""
    dtype, kind = _float_type(hidden), hidden.device.type
    compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.promote_types(hidden.dtype, weight.dtype)
    logprobs = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
    entropies = torch.empty_like(logprobs) if entropy or probs is not None else None
    with torch.autocast(kind, enabled=False):
        w, b = weight.to(compute), None if bias is None else bias.to(compute)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            z = F.linear(hidden[rows].to(compute), w, b).to(dtype)  # (chunk, V)
            if temperature != 1.0:
                z = z.div_(temperature)
            log_p = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # in place: z is this chunk's own
            logprobs[rows] = log_p.gather(-1, targets[rows, None]).squeeze(-1)
            if entropies is not None:
                p = torch.exp(log_p) if probs is None else torch.exp(log_p, out=probs[rows])
                entropies[rows] = -(p * log_p).sum(-1)
    return logprobs, entropies, compute


class _HeadScores(torch.autograd.Function):
    """Log-probs of the target tokens AND the entropy at each position of softmax(head(hidden) / tau),
    in one pass over chunks of positions: the logits exist one chunk at a time; what backward keeps is
    the (K, V) probabilities (float32), turned in place into the logits' gradient (one multiply and a
    scatter; so a graph through it can be backpropagated once: autograd refuses a second backward,
    the saved probabilities having been modified in place), with no recomputed LM head. The
    entropy's gradient is taken only when asked for (`entropy_grad`), else the entropy is returned
    detached (a metric).

    With z = logits / tau, p = softmax(z): d log p_target / dz = onehot - p, dH/dz = -p (log p + H);
    d/dlogits = d/dz / tau. Matmuls run in the dtype they would outside this function (the autocast
    dtype under bf16-mixed, as `_HeadLogprobs`), the softmax in float32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, entropy_grad, chunk_size):
        probs = torch.empty(hidden.shape[0], weight.shape[0], dtype=_float_type(hidden), device=hidden.device)
        logprobs, entropy, compute = _head_pass(hidden, weight, bias, targets, temperature, chunk_size, probs)
        ctx.save_for_backward(hidden, weight, bias, targets, probs, entropy)
        ctx.temperature, ctx.entropy_grad, ctx.compute = temperature, entropy_grad, compute
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, probs, entropy = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        compute, tau = ctx.compute, ctx.temperature
        w = weight.to(compute)
        grad_hidden = grad_weight = grad_bias = None
        g = torch.zeros_like(entropy) if grad_logprobs is None else grad_logprobs.to(probs.dtype) / tau  # (K,)
        entropy_term = None
        if ctx.entropy_grad and grad_entropy is not None:  # p (log p + H) dH, with p log p -> 0 where p underflowed to 0
            entropy_term = (torch.special.xlogy(probs, probs) + probs * entropy[:, None]) * (grad_entropy.to(probs.dtype) / tau)[:, None]
        grad_z = probs.mul_(-g[:, None])  # (K, V): the logits' gradient, in the probabilities' own memory
        grad_z.scatter_add_(-1, targets[:, None], g[:, None])
        if entropy_term is not None:
            grad_z -= entropy_term
        grad_z = grad_z.to(compute)
        if need_hidden:
            grad_hidden = (grad_z @ w).to(hidden.dtype)
        if need_weight:
            grad_weight = (grad_z.T @ hidden.to(compute)).to(weight.dtype)
        if need_bias:
            grad_bias = grad_z.sum(0).to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def head_scores(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
                entropy_grad: bool = False, chunk_size: int = 128, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and the entropy of softmax(head(hidden) / temperature) at each position,
    without any (K, V) logits kept: equal to ``token_logprobs(head(hidden), targets, temperature)`` and
    ``token_entropy(head(hidden), temperature)`` (``entropy(...)`` with ``entropy_grad``), in one pass
    over the vocabulary instead of four or five, and a backward that reuses the forward's probabilities
    rather than a log-softmax's backward and a scatter into zeros of the logits' size (the policy-gradient
    update's head; `head_logprobs` is the same for the log-probs alone, recomputing the head in backward).

    Args:
        hidden: (K, H) final hidden states at the positions that predict ``targets``.
        head: the model's output embedding, a plain ``nn.Linear`` (V, H) (bias optional).
        targets: (K,) long token ids.
        temperature: > 0, the sampling temperature.
        entropy_grad: give the entropy its gradient (an entropy bonus); else it is detached.
        chunk_size: positions per chunk of the forward and backward.
        entropy: False skips the entropies (None) where no gradient is taken (a no-grad forward's log-probs).

    Returns:
        (K,) log-probs, differentiable w.r.t. ``hidden`` and the head's weight and bias, and (K,) entropies;
        float32 (float64 for float64 inputs). Backward keeps (K, V) float32 probabilities: the memory of
        the logits it replaces, without their log-softmax's and gradient's copies. Where no gradient
        is needed (no grad mode, or nothing requires grad) nothing is kept, and the log-probs are the
        same bits the training forward of the same rows gives.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape or hidden.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be (K, H) with targets (K,), got {tuple(targets.shape)}")
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, head.weight, head.bias))
    if not needs_grad:
        logprobs, entropies, _ = _head_pass(hidden, head.weight, head.bias, targets, temperature, chunk_size, entropy=entropy)
        return logprobs, entropies
    return _HeadScores.apply(hidden, head.weight, head.bias, targets, temperature, entropy_grad, chunk_size)
