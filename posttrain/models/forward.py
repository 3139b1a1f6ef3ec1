"""The ONE place that turns (model, token batch) into what a loss needs: per-token log-probs of
given tokens, summed response log-probs, and values. Every recipe, test and benchmark goes through
these functions; `TrainingForward` is the one module DDP / FSDP2 wrap around them.

What is computed is only what the loss needs:

* `completion_logits`: the logits that score the completion tokens of rollout rows, each distinct
  prompt once (`shared_prefix_logits`, below); `completion_logprobs` / `rank_logprobs` turn them
  into (N, T) log-probs at a temperature (no grad), `completion_values` gives a critic's (N, T) values;
* `policy_scores`: what the policy-gradient update trains through: the decoder's last hidden states at
  the completion positions (shared prefix as below), then the fused LM head (`algorithms.head_scores`)
  on the real completion tokens only: their log-probs and entropies in one pass, no (n, T, V) logits.
  `completion_logprobs` takes a policy's no-grad log-probs through the same pass, to the bit;
* `response_sums`: the LM head only where a response token is predicted (SFT's and DPO's per-row forward).

The shared prefix. The G rows of a GRPO group carry the same left-padded prompt (often most of each
row's positions), so a plain forward over prompt + completion computes every prompt G times. Here,
for the rows of one micro-batch:

1. find the k distinct prompts among the n rows, by prompt ids *and* mask (no group size needed,
   and any subset of rows works: rows of the same group share, the rest cost what they did);
2. forward the k prompts once with a KV cache, the LM head only at the last position, whose logits
   score completion token 0;
3. copy each prompt's cache to its rows with an index (differentiable: the gradients of all G
   completions flow back into the one prompt computation);
4. forward completion tokens 0..T-2 of every row on that cache (mask = prompt padding + completion,
   same position ids as the plain forward); their logits score completion tokens 1..T-1.

When no two rows share a prompt it is one plain forward, still with the LM head only on the T
positions that score completion tokens (not on every prompt position).
DPO uses it too (`hidden_states=True`): the chosen and rejected rows of a pair share their prompt.
Checked against the plain forward (logits and parameter gradients) in tests/test_shared_prefix.py
and, for DPO, tests/test_dpo.py.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import DynamicCache

from posttrain.algorithms import head_logprobs, response_logprobs, sequence_logprobs, token_logprobs
from posttrain.algorithms.logprobs import entropy as entropy_with_grad
from posttrain.algorithms.logprobs import head_scores, token_entropy
from posttrain.data import position_ids_from_attention_mask
from posttrain.distributed import World, full_weights
from posttrain.hardware import Placement, cpu_placement

SUPPORTED_MODEL_TYPES = ("llama",)
"""Architectures checked against the plain forward (tiny and SmolLM2 are Llama)."""


def _transformers_model(model):
    """The transformers model inside a `ReferenceModel` and/or a PEFT wrapper, else `model`."""
    model = getattr(model, "model", model) if not isinstance(model, torch.nn.Module) else model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoder(model):
    """The decoder stack of a causal LM or sequence classifier (PEFT-wrapped or not): its `get_decoder()`,
    else its base model attribute."""
    return model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)


def _cache_argument(model, hidden_states: bool = False) -> str | None:
    """The forward's KV-cache keyword (`cache` since transformers 5, else `past_key_values`), or
    None if `model` is not a supported architecture taking that and `logits_to_keep` (with
    `hidden_states`: its decoder taking the cache, the head being the caller's, as a reward model's)."""
    inner = _transformers_model(model)
    if getattr(getattr(inner, "config", None), "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    if checkpointing(inner):
        return None
    if hidden_states:
        parameters = inspect.signature(_decoder(model).forward).parameters
    else:
        parameters = inspect.signature(inner.forward).parameters
        if "logits_to_keep" not in parameters:
            return None
    return "cache" if "cache" in parameters else "past_key_values" if "past_key_values" in parameters else None


def checkpointing(model) -> bool:
    """True when a forward of `model` now would checkpoint its decoder layers (gradient
    checkpointing on, training mode, gradients enabled). transformers then drops the KV cache a
    layer is given (a replay in backward would write it twice), so the shared-prefix pass, which
    reads the prompt's cache, is skipped: the plain forward gives the same logits and gradients."""
    inner = _transformers_model(model)
    if not (torch.is_grad_enabled() and getattr(inner, "training", False)):
        return False
    name = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(inner, name, False))  # renamed in transformers 5.2x


def shared_prefix_logits(model, inputs: dict[str, torch.Tensor], rows, prompt_width: int, T: int,
                         hidden_states: bool = False) -> torch.Tensor | None:
    """Logits (n, T, V) whose position t scores completion token t, equal to
    `model(**inputs).logits[rows][:, P - 1 : P - 1 + T]` (P = `prompt_width`), or None if `model`
    is not supported (the caller then runs the plain forward).

    Args:
        model: a causal LM, PEFT-wrapped or not, or a `ReferenceModel` (called as `model(**kwargs)`).
        inputs: `Rollout.forward_inputs()`: input_ids, attention_mask, position_ids, each (N, P + T).
        rows: which rows (a slice or an (n,) index tensor).
        hidden_states: return the decoder's last hidden states (n, T, H) at those positions instead
            (`model.get_decoder()`; not a `ReferenceModel`), for a caller that runs the LM head on
            the few positions it needs: the (n, T, V) logits are most of a small model's memory.
    """
    cache_argument = _cache_argument(model, hidden_states)
    if cache_argument is None or T < 1:
        return None
    if hidden_states:
        decoder = _decoder(model)

        def forward(keep: int, **kwargs) -> torch.Tensor:  # the last `keep` positions (0: all), like logits_to_keep
            return decoder(**kwargs).last_hidden_state[:, -keep:]
    else:
        def forward(keep: int, **kwargs) -> torch.Tensor:
            return model(**kwargs, logits_to_keep=keep).logits
    P = prompt_width
    input_ids, attention_mask = inputs["input_ids"][rows], inputs["attention_mask"][rows]  # (n, P + T)
    position_ids = inputs["position_ids"][rows]
    n = input_ids.shape[0]
    prompts = torch.cat([input_ids[:, :P], attention_mask[:, :P]], dim=1)  # (n, 2P)
    distinct, inverse = torch.unique(prompts, dim=0, return_inverse=True)  # (k, 2P), (n,)
    k = distinct.shape[0]
    if k == n:  # nothing shared: one forward, LM head on columns P-1 .. P+T-1, the last one dropped
        return forward(T + 1, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)[:, :T]
    # First row of each distinct prompt, (k,): its prompt columns are the ones computed.
    first = torch.full((k,), n, dtype=torch.long, device=inverse.device).scatter_reduce(
        0, inverse, torch.arange(n, device=inverse.device), reduce="amin")
    cache = DynamicCache(config=_transformers_model(model).config)
    logits = forward(
        1, input_ids=input_ids[first, :P], attention_mask=attention_mask[first, :P], position_ids=position_ids[first, :P],
        use_cache=True, **{cache_argument: cache},
    )[inverse]  # (n, 1, V), or (n, 1, H) for hidden_states: scores completion token 0
    if T == 1:
        return logits
    cache.reorder_cache(inverse)  # (k, ...) -> (n, ...) along the batch dimension, differentiable
    completion_logits = forward(
        0, input_ids=input_ids[:, P : P + T - 1], attention_mask=attention_mask[:, : P + T - 1],
        position_ids=position_ids[:, P : P + T - 1], use_cache=True, **{cache_argument: cache},
    )
    return torch.cat([logits, completion_logits], dim=1)  # (n, T, V)


def response_sums(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                  full_forward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) summed response log-probs and (N,) response lengths of (N, L) rows.

    The LM head runs only on the K positions that predict a response token (hidden (K, H) ->
    logits (K, V)), never on prompt or padding positions: for a 49k-token vocabulary the full
    (N, L, V) logits are most of a step's time and memory. Models whose head does more than a
    linear map (logit soft-capping or scaling) take the plain full forward.
    """
    position_ids = position_ids_from_attention_mask(attention_mask)
    if full_forward or scaled_logits(model) or model.get_output_embeddings() is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits  # (N, L, V)
        logprobs, shifted_mask = response_logprobs(logits, input_ids, mask)
        return sequence_logprobs(logprobs, shifted_mask), shifted_mask.sum(-1)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    shifted_mask = mask[:, 1:]  # position t predicts token t + 1
    rows, columns = shifted_mask.nonzero(as_tuple=True)
    logprobs = response_head_logprobs(model, hidden[rows, columns], input_ids[rows, columns + 1])  # (K,)
    sums = torch.zeros(input_ids.shape[0], dtype=logprobs.dtype, device=logprobs.device).index_add(0, rows, logprobs)
    return sums, shifted_mask.sum(-1)


def response_head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(K,) log-probs of `targets` from (K, H) final hidden states through the model's LM head: the
    chunked `head_logprobs` (no (K, V) logits kept for backward) for a plain linear head, else
    (a LoRA-wrapped head) the head's own forward and `token_logprobs`."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:
        return head_logprobs(hidden, head, targets)
    return token_logprobs(head(hidden), targets)


def completion_logits(model, inputs: dict[str, torch.Tensor], rows, prompt_width: int, T: int, shared_prefix: bool = True, **extra):
    """Forward prompt + completion rows; returns the model output and the logits (n, T, V) whose
    position t scores completion token t (see `Rollout.forward_inputs`). Without `extra`, a supported
    model runs `shared_prefix_logits` (each distinct prompt once) and the output is None, unless
    `shared_prefix` is False (one plain model call, whatever the rows)."""
    if not extra and shared_prefix:
        logits = shared_prefix_logits(model, inputs, rows, prompt_width, T)
        if logits is not None:
            return None, logits
    output = model(
        input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
        position_ids=inputs["position_ids"][rows], **extra,
    )
    return output, output.logits[:, prompt_width - 1 : prompt_width - 1 + T]


@dataclass
class CompletionScores:
    """What the policy-gradient loss reads of one training forward over n rollout rows: the (n, T)
    log-probs of the sampled tokens (with gradient), the (n, T) entropies of the sampling distribution
    (with gradient only when asked for: an entropy bonus; else a metric), the critic's (n, T) values
    (None without one) and `logits_at(rows, columns)`: the (k, V) full logits at k positions (rows
    numbered 0..n-1), detached, recomputed from the kept hidden states where the logits were never
    materialised (e.g. the exact KL's positions). Positions outside the forward's `score_mask` hold 0."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    logits_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    values: torch.Tensor | None = None


def scaled_logits(model) -> bool:
    """True when the model's logits are more than its head's output (logit soft-capping or scaling)."""
    config = getattr(_transformers_model(model), "config", None)
    return any(getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


def plain_head(model) -> torch.nn.Linear | None:
    """The model's LM head when its logits are exactly `head(last hidden state)`: a plain `nn.Linear`
    (not LoRA-wrapped), no logit soft-capping or scaling; else None (the caller takes the logits)."""
    if scaled_logits(model):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if type(head) is torch.nn.Linear else None


def completion_hidden(model, inputs: dict[str, torch.Tensor], rows, prompt_width: int, T: int, shared_prefix: bool = True) -> torch.Tensor:
    """(n, T, H) final hidden states at the positions whose logits score completion tokens 0..T-1
    (what `completion_logits` puts through the LM head): each distinct prompt once when
    `shared_prefix` and the model allows, else one plain decoder call."""
    hidden = shared_prefix_logits(model, inputs, rows, prompt_width, T, hidden_states=True) if shared_prefix else None
    if hidden is None:
        hidden = _decoder(model)(input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
                                 position_ids=inputs["position_ids"][rows]).last_hidden_state[:, prompt_width - 1 : prompt_width - 1 + T]
    return hidden


def scores_from_hidden(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                       entropy_grad: bool = False, score_mask: torch.Tensor | None = None, entropy: bool = True) -> CompletionScores:
    """`CompletionScores` of (n, T, H) hidden states through a plain LM head, the fused `head_scores`
    on the `score_mask` (n, T) positions only (all when None): no (n, T, V) logits exist. `entropy`
    False (no gradient taken) leaves the entropies out (None)."""
    n, T, H = hidden.shape
    if score_mask is None:
        score_mask = torch.ones(n, T, dtype=torch.bool, device=hidden.device)
    rows, columns = score_mask.nonzero(as_tuple=True)
    picked, entropy_picked = head_scores(hidden[rows, columns], head, targets[rows, columns], temperature, entropy_grad, entropy=entropy)
    logprobs = picked.new_zeros(n, T).index_put((rows, columns), picked)
    entropy = None if entropy_picked is None else entropy_picked.new_zeros(n, T).index_put((rows, columns), entropy_picked)
    kind = hidden.device.type
    autocast = {"dtype": torch.get_autocast_dtype(kind), "enabled": torch.is_autocast_enabled(kind)}

    def logits_at(at_rows: torch.Tensor, at_columns: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast(kind, **autocast):  # the precision the forward ran at
            return head(hidden[at_rows, at_columns])

    return CompletionScores(logprobs, entropy, logits_at)


def scores_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy_grad: bool = False,
                       entropy: bool = True) -> CompletionScores:
    """`CompletionScores` of (n, T, V) logits (a head that is not a plain linear map, or a sharded model)."""
    if entropy_grad:
        entropy = entropy_with_grad(logits, temperature)
    else:
        entropy = token_entropy(logits, temperature) if entropy else None
    return CompletionScores(token_logprobs(logits, targets, temperature), entropy, lambda rows, columns: logits[rows, columns].detach())


def policy_scores(model, inputs: dict[str, torch.Tensor], rows, prompt_width: int, T: int, targets: torch.Tensor,
                  temperature: float, entropy_grad: bool = False, score_mask: torch.Tensor | None = None,
                  shared_prefix: bool = True, full_forward: bool = False, detach_hidden: bool = False,
                  entropy: bool = True) -> CompletionScores:
    """The `CompletionScores` (no values) of some rows of a rollout's `forward_inputs()` that a policy
    without a critic trains through: the decoder over each distinct prompt once (`shared_prefix`),
    then the fused LM head (`scores_from_hidden`) on the `score_mask` positions; the (n, T, V) logits
    instead when the head is not plain (`plain_head`) or `full_forward` (an FSDP2-sharded model, whose
    head must run as a module). `targets` (n, T) are the sampled tokens; `detach_hidden` (the critic's
    option) has nothing to detach here; `entropy` False (a no-grad forward) skips the entropies."""
    head = None if full_forward else plain_head(model)
    if head is None:
        logits = completion_logits(model, inputs, rows, prompt_width, T, shared_prefix=shared_prefix)[1]
        return scores_from_logits(logits, targets, temperature, entropy_grad, entropy)
    hidden = completion_hidden(model, inputs, rows, prompt_width, T, shared_prefix)
    return scores_from_hidden(head, hidden, targets, temperature, entropy_grad, score_mask, entropy)


@dataclass
class LogitTap:
    """A few positions of a rollout (rows (k,), columns (k,) long) whose full-vocabulary logits a
    forward that computes them anyway keeps, detached: `logits` (k, V), filled by `take` (e.g. the
    exact KL to the reference measured on the forwards a step runs, not on forwards of its own)."""

    rows: torch.Tensor
    columns: torch.Tensor
    logits: torch.Tensor | None = None

    def take(self, rows: torch.Tensor, logits_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Keep the tapped positions among `rows` ((n,) long, the rollout rows a forward scored), from
        `logits_at(local rows (m,), columns (m,))` -> (m, V) logits (local rows numbered 0..n-1, as
        `CompletionScores.logits_at`); positions of other rows are left as they are."""
        match = self.rows[:, None] == rows[None, :]  # (k, n)
        inside = match.any(1)
        if not bool(inside.any()):
            return
        logits = logits_at(match[inside].float().argmax(1), self.columns[inside]).detach()
        if self.logits is None:
            self.logits = logits.new_zeros(len(self.rows), logits.shape[-1])
        self.logits[inside] = logits.to(self.logits.dtype)

    def local(self, rows: torch.Tensor) -> LogitTap:
        """The same positions numbered within the sub-rollout `rollout.select(rows)` ((n,) long,
        ascending, holding every tapped row)."""
        return LogitTap(torch.searchsorted(rows, self.rows), self.columns)


@torch.no_grad()
def completion_logprobs(model, rollout, inputs: dict[str, torch.Tensor], temperature: float, micro_batch_size: int,
                        tap: LogitTap | None = None) -> torch.Tensor:
    """(N, T) log-probs of a rollout's sampled tokens under `model` at `temperature` (float32, 0 at
    padding), no grad, micro-batched: `policy_scores` without entropies, so a policy's are the bits its
    training forward of the same rows gives; `tap` keeps the logits of its positions on the way."""
    prompt_width, (N, T) = rollout.prompt_ids.shape[1], rollout.completion_ids.shape
    pieces = []
    for start in range(0, N, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        scores = policy_scores(model, inputs, rows, prompt_width, T, rollout.completion_ids[rows], temperature,
                               score_mask=rollout.mask[rows], entropy=False)
        if tap is not None:
            tap.take(torch.arange(start, min(N, start + micro_batch_size), device=scores.logprobs.device), scores.logits_at)
        pieces.append(scores.logprobs)
    return torch.cat(pieces).masked_fill(~rollout.mask, 0.0)


def rank_logprobs(model, rollout, owners: torch.Tensor, world: World, temperature: float, micro_batch_size: int,
                  tap: LogitTap | None = None) -> torch.Tensor:
    """(N, T) log-probs of every sampled token under `model` (no grad): each rank computes the rows
    it owns (`owners` (N,) long) and the pieces are summed across ranks; in one process simply
    `completion_logprobs`. An FSDP2-sharded model is made whole for the pass, so ranks need not run
    equally many forwards. `tap` (positions in this rank's own rows) keeps their logits."""
    if not world.active:
        return completion_logprobs(model, rollout, rollout.forward_inputs(), temperature, micro_batch_size, tap)
    mine = (owners == world.rank).nonzero().squeeze(1)
    full = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    with full_weights(model):
        if len(mine):
            part, local = rollout.select(mine), None if tap is None else tap.local(mine)
            full[mine] = completion_logprobs(model, part, part.forward_inputs(), temperature, micro_batch_size, local)
            if tap is not None:
                tap.logits = local.logits
    return world.reduce(full)


def completion_values(critic, inputs: dict[str, torch.Tensor], P: int, T: int, micro_batch_size: int, rows=None, grad: bool = False) -> torch.Tensor:
    """(n, T) values V(s_t) of the state before each completion token (the hidden state of the
    token preceding it, like the logits that score it), micro-batched; no grad unless `grad`."""
    rows = torch.arange(inputs["input_ids"].shape[0], device=inputs["input_ids"].device) if rows is None else rows
    pieces = []
    with torch.set_grad_enabled(grad):
        for start in range(0, len(rows), micro_batch_size):
            chunk = rows[start : start + micro_batch_size]
            values = critic(input_ids=inputs["input_ids"][chunk], attention_mask=inputs["attention_mask"][chunk],
                            position_ids=inputs["position_ids"][chunk])
            pieces.append(values[:, P - 1 : P - 1 + T])
    return torch.cat(pieces)


def policy_and_critic(models: torch.nn.ModuleDict, inputs: dict[str, torch.Tensor], rows, P: int, T: int, targets: torch.Tensor,
                      temperature: float, entropy_grad: bool = False, score_mask: torch.Tensor | None = None,
                      share_backbone: bool = False, detach_hidden: bool = False, full_forward: bool = False) -> CompletionScores:
    """The policy's `CompletionScores` of some rows with the critic's (n, T) values, in one pass: the
    values from the policy's last hidden states through the value head when the critic shares its
    backbone (hidden states detached when `detach_hidden`: the backbone then gets no value gradient),
    else from the critic's own forward. `models` holds "policy" and "critic"; the other arguments are
    `policy_scores`'s (one plain forward: no shared prefix)."""
    policy, critic = models["policy"], models["critic"]
    head = None if full_forward else plain_head(policy)
    if head is None:
        output = policy(input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
                        position_ids=inputs["position_ids"][rows], output_hidden_states=share_backbone)
        scores = scores_from_logits(output.logits[:, P - 1 : P - 1 + T], targets, temperature, entropy_grad)
        hidden = output.hidden_states[-1][:, P - 1 : P - 1 + T] if share_backbone else None
    else:
        hidden = completion_hidden(policy, inputs, rows, P, T, shared_prefix=False)
        scores = scores_from_hidden(head, hidden, targets, temperature, entropy_grad, score_mask)
    if share_backbone:
        scores.values = critic.values_from_hidden(hidden.detach() if detach_hidden else hidden)
    else:
        scores.values = completion_values(critic, inputs, P, T, len(rows), rows=rows, grad=True)
    return scores


def batch_response_sums(model, batch, rows, full_forward: bool = False) -> torch.Tensor:
    """(n,) summed response-token log-probs of `rows` of a token batch with `input_ids`,
    `attention_mask` and `mask` (L-wide each): `response_sums` on those rows."""
    sums, _ = response_sums(model, batch.input_ids[rows], batch.attention_mask[rows], batch.mask[rows], full_forward)
    return sums


class TrainingForward(torch.nn.Module):
    """The one module a recipe trains through: `forward(*args)` = `function(model, *args, **options)`,
    one recipe-defined pass over some rows under the run's precision (`placement.autocast()`), so DDP (which syncs per forward) and FSDP2 (which pairs
    calls across ranks) see one call however many model calls it makes. It holds the model (a
    module, or a `ModuleDict` of several) and no parameters of its own; FSDP2 shards the model.

        TrainingForward(policy, policy_scores, shared_prefix=True)(inputs, rows, P, T, targets, temperature)  # CompletionScores
    """

    def __init__(self, model: torch.nn.Module, function: Callable[..., Any], placement: Placement | None = None, **options: Any):
        super().__init__()
        self.model, self.function, self.options = model, function, options
        self.placement = placement or cpu_placement()

    @property
    def sharding_root(self) -> torch.nn.Module:
        return self.model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.placement.autocast():  # bf16-mixed: the forward under autocast; backward outside it
            return self.function(self.model, *args, **{**self.options, **kwargs})
