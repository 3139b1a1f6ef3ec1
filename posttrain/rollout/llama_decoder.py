"""The fast decoder: Llama-family models (Llama, Mistral, Qwen2, Qwen3) decoded by our own loop.

Why not ``model.forward``: a decode step of a small model is a few matmuls per layer, and the
Hugging Face forward adds masks, cache bookkeeping and ~30 small ops per layer around them, which
together cost a large share of the step (docs/rollout.md, "The measurements behind these choices").
This decoder reads the model's own weights and keeps only what a decode step needs:

* one preallocated KV cache ``(L, 2, n, K, S, D)``, each key block stored transposed as ``(D, S)``
  (the decode attention then sums over columns without horizontal adds); all rows are left-padded
  to a common prompt length, so every row writes its new key/value into the same column, and left
  padding is a ``-inf`` additive key bias plus per-row position ids;
* fused projections (q|k|v in one matmul, gate|up in one matmul, residual adds fused into o_proj
  and down_proj);
* on CPU, the C kernels of ``posttrain.rollout.kernels`` for the matmuls (weights copied into their
  blocked layout), norms, rope, attention and SwiGLU; without a C compiler, weights prepacked for
  oneDNN and torch ops. The weight copy (mostly page faults) is kept for the next call while the
  weights are unchanged. "Unchanged" is checked on every call by each parameter's storage pointer
  and version counter (optimizer steps, state-dict loads, in-place ops) *and* its float32 sum (a
  small fraction of the copy's cost), because writes through ``param.data`` do not bump the
  version counter. Elsewhere, plain ``F.linear`` on fused weights.

Across calls (the turns of tool episodes, ``engine.Session``): ``export`` copies a row's cache out
as it ends a turn, packed (its padding and holes dropped), and ``resume`` rebuilds a cache from such
rows and runs only each row's new tokens on top, with per-row position ids and a masked hole where
a row has fewer new tokens than the longest (tests/test_episode_cache.py: the logits of a fresh
prefill of the whole context). The prompt columns that G rows share (``kernels.Sharing``) are
exported once per group (``SharedPrefix``) and resumed shared again, so a later turn's decode
reads a prompt's keys and values once per group, as the first turn's does.

It is checked against the model's own forward (logits) and against ``model.generate`` (greedy
tokens) in tests/test_rollout_decoders.py. PEFT LoRA layers are supported by folding the active
adapters into the copy of the weights (``decoder_weights.py``; the model is not touched).
Anything it does not recognise (other architectures, DoRA, sliding-window attention shorter than
the sequence) goes to ``HFDecoder``.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.rollout import kernels
from posttrain.rollout.decoder_weights import Layer, build_layers, linear_problem, projections, unwrap

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model: torch.nn.Module, capacity: int) -> str | None:
    """Why the fast decoder cannot run ``model`` for sequences of ``capacity`` tokens (None if it can)."""
    model = unwrap(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "no model.model.layers / rotary_emb"
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
    if model_type == "mistral" and window is not None:
        sliding = True
    if sliding and window is not None and window < capacity:
        return f"sliding window {window} < sequence length {capacity}"
    for module in [m for layer in body.layers for m in projections(layer)] + [model.get_output_embeddings()]:
        problem = linear_problem(module)
        if problem is not None:
            return problem
    if type(model.get_input_embeddings()) is not torch.nn.Embedding:
        return f"input embedding of type {type(model.get_input_embeddings()).__name__}"
    return None


@dataclass
class SharedPrefix:
    """Keys and values that the contexts of several exported rows begin with (the prompt the G rows
    of a group were sampled from): copied out once per group, referenced by each row's ``RowCache``."""

    keys: torch.Tensor
    """(L, K, D, p), packed, stored transposed as in the decoder's cache."""
    values: torch.Tensor
    """(L, K, p, D)."""


@dataclass
class RowCache:
    """One row's keys and values after a turn (``LlamaDecoder.export``), for ``LlamaDecoder.resume``:
    the c tokens of its context before its last sampled token, packed (no padding, no holes: rope is
    already in the keys, so a column's place in the cache does not matter, only its mask): the
    ``prefix`` it shares with the other rows of its group, then its own columns."""

    keys: torch.Tensor
    """(L, K, D, c_own), the row's own columns after the prefix, stored transposed as in the decoder's cache."""
    values: torch.Tensor
    """(L, K, c_own, D)."""
    position: int
    """The position id of the next token the row reads (its last sampled token)."""
    prefix: SharedPrefix | None = None
    """The columns before ``keys``, the same object for every row of the group; None: no shared columns."""


def _without_cpu_autocast(method):
    """Run a decoder method with CPU autocast off when the C kernels are in use: they read and write
    float32 buffers, and a bf16 tensor from an autocast op would be read as float32 (bf16-mixed on
    the CPU therefore samples in float32, like the kernels always do)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not self.kernels:
            return method(self, *args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            return method(self, *args, **kwargs)
    return wrapper


class LlamaDecoder:
    """Decoding Llama-family models with a static KV cache; same interface as ``HFDecoder``."""

    def __init__(self, model: torch.nn.Module, batch_hint: int = 16, use_kernels: bool | None = None):
        """use_kernels: run the matmuls, norms, rope, attention and SwiGLU in the C kernels
        (posttrain/rollout/kernels.py); None = whenever they build here and the model is float32 on
        CPU; False = torch ops and oneDNN-prepacked weights (the reference path)."""
        embed = unwrap(model).get_input_embeddings().weight
        # Under CUDA autocast (bf16-mixed) the copy of the weights and the cache are kept in the
        # autocast dtype: a decode step then reads half the bytes and casts nothing.
        dtype = torch.get_autocast_dtype("cuda") if embed.is_cuda and torch.is_autocast_enabled("cuda") else None
        self.layers, self.lm_head = build_layers(model, batch_hint, use_kernels is not False, dtype=dtype)
        model = unwrap(model)
        config = model.config
        self.model = model
        cast = (lambda weight: weight.detach().to(dtype)) if dtype is not None else (lambda weight: weight)
        self.embed = cast(embed)
        self.rotary = model.model.rotary_emb
        self.final_norm = cast(model.model.norm.weight)
        self.eps = model.model.norm.variance_epsilon
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = model.model.layers[0].self_attn.scaling
        self.buffer = None  # (L, 2, rows allocated, K, S, D)
        self.kv = None  # (L, 2, n, K, S, D): the first n rows of the buffer
        self.views = []  # per layer: keys (n, K, D, S), values (n, K, S, D), and both with n*K merged
        self.key_bias = None  # (n, S) float: 0 = attend, -inf = left padding
        self.positions = None  # (n,) long: position id of the next token
        self.column = 0  # cache column the next token is written to (same for every row)
        usable = kernels.usable(self.embed) and self.head_dim % 16 == 0 and self.head_dim <= kernels.MAX_HEAD_DIM
        if use_kernels and not usable:
            raise ValueError("the rollout kernels cannot run here (see the log) or not for this model's dtype/device")
        self.kernels = usable if use_kernels is None else use_kernels
        self.sharing = None  # kernels.Sharing: rows with the same prompt columns
        self.prefixes = {}  # group id in self.sharing -> SharedPrefix of its shared columns, once exported
        self.kernel_args = []  # per layer: kernels.AttentionArgs, rebuilt when the cache's rows change
        self.scratch = ()  # kernels' q (rows, H, D), scores (rows, H, S), attention output (rows, H * D)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] = roll(x, D/2) * [-1, 1]."""
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), sin_signed)

    def _cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (..., 1, D) for position ids (...), from the model's own rotary module (any rope
        type); sin is signed for the roll form of rotate_half; the 1 broadcasts over heads."""
        probe = self.embed[:1]
        cos, sin = self.rotary(probe, position_ids.reshape(1, -1))
        cos, sin = cos.reshape(*position_ids.shape, 1, -1), sin.reshape(*position_ids.shape, 1, -1)
        half = sin.shape[-1] // 2
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return cos, sin_signed

    def _qkv(self, layer: Layer, h: torch.Tensor, cos, sin_signed):
        """(..., d) hidden -> q (..., H, D), k (..., K, D) with rope, v (..., K, D)."""
        H, K = self.heads, self.kv_heads
        qkv = layer.qkv(h).unflatten(-1, (H + 2 * K, self.head_dim))
        if layer.q_norm is not None:  # Qwen3: RMSNorm over each head before rope
            q = self._rope(self._norm(qkv[..., :H, :], layer.q_norm), cos, sin_signed)
            k = self._rope(self._norm(qkv[..., H:H + K, :], layer.k_norm), cos, sin_signed)
            return q, k, qkv[..., H + K:, :]
        qk = self._rope(qkv[..., :H + K, :], cos, sin_signed)  # one rope for the q and k heads together
        return qk[..., :H, :], qk[..., H:, :], qkv[..., H + K:, :]

    @torch.inference_mode()
    @_without_cpu_autocast
    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, capacity: int,
                max_rows: int = 0) -> torch.Tensor:
        """Run the left-padded prompts, fill the cache; see ``HFDecoder.prefill``.

        Args:
            prompt_ids: (B, P) long. prompt_mask: (B, P) bool. capacity: S >= P + new tokens.
            max_rows: rows the cache will hold after ``select`` (B * G), allocated once up front.

        Returns:
            (B, V) float32 next-token logits.
        """
        B, P = prompt_ids.shape
        L, K, D = len(self.layers), self.kv_heads, self.head_dim
        capacity = -(-capacity // 16) * 16  # the kernels read keys 16 columns at a time
        # Uninitialised on purpose: a column is always written (prompt or decode step) before any
        # attention reads it, and zero-filling the buffer costs as much as the page faults it causes.
        self.buffer = torch.empty(L, 2, max(B, max_rows), K, capacity, D, dtype=self.embed.dtype,
                                  device=self.embed.device)
        self.kv = self.buffer[:, :, :B]
        self.key_bias = torch.zeros(B, capacity, dtype=self.embed.dtype, device=self.embed.device)
        self.key_bias[:, :P].masked_fill_(~prompt_mask, float("-inf"))
        position_ids = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
        self.positions = position_ids[:, -1] + 1
        self.column = P
        cos, sin_signed = self._cos_sin(position_ids)  # (B, P, 1, D)
        causal = torch.ones(P, P, dtype=torch.bool, device=prompt_ids.device).tril()
        allowed = (causal & prompt_mask[:, None, :]) | torch.eye(P, dtype=torch.bool, device=prompt_ids.device)
        allowed = allowed.unsqueeze(1)  # (B, 1, P, P); the diagonal keeps padding rows finite
        x = F.embedding(prompt_ids, self.embed)  # (B, P, d)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._norm(x, layer.input_norm), cos, sin_signed)  # (B, P, *, D)
            self.kv[index, 0].view(B, K, D, capacity)[..., :P] = k.permute(0, 2, 3, 1)  # keys stored (D, S)
            self.kv[index, 1, :, :, :P] = v.transpose(1, 2)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
                scale=self.scaling, enable_gqa=self.heads != K)  # (B, H, P, D)
            x = layer.o.plus(attn.transpose(1, 2).reshape(B * P, -1), x.reshape(B * P, -1)).view(B, P, -1)
            x = self._mlp(layer, x.view(B * P, -1)).view(B, P, -1)
        self.sharing, self.prefixes = kernels.Sharing.distinct(B), {}
        if self.kernels:
            H, rows = self.heads, max(B, max_rows)
            self.scratch = (torch.empty(rows, H, D), torch.empty(rows, H, capacity), torch.empty(rows, H * D))
        self._make_views()
        return self.lm_head(self._norm(x[:, -1], self.final_norm)).float()

    @torch.inference_mode()
    def export(self, rows: list[int]) -> list[RowCache]:
        """Copies of cache rows ``rows`` (indices into the current rows): the columns written so far
        that the row attends to (its left padding and holes dropped). Taken when a row ends a turn,
        before ``select`` drops it. The shared columns ``[0, sharing.shared)`` are copied once per
        group, when its first row ends, into the ``SharedPrefix`` that each of its rows refers to."""
        L, _, n, K, S, D = self.kv.shape
        keys, values = self.kv[:, 0].view(L, n, K, D, S), self.kv[:, 1]  # keys stored (D, S)
        index = torch.tensor(rows, dtype=torch.long, device=self.key_bias.device)
        real = (self.key_bias.index_select(0, index)[:, :self.column] == 0).cpu()  # (k, column): one synchronisation
        positions = self.positions.index_select(0, index).tolist()
        shared = self.sharing.shared
        caches = []
        for row, columns, position in zip(rows, real, positions):
            group = self.sharing.group_of[row]
            if shared and group not in self.prefixes:
                prefix = columns[:shared].nonzero().squeeze(1).to(keys.device)
                self.prefixes[group] = SharedPrefix(keys[:, row].index_select(-1, prefix),
                                                    values[:, row].index_select(-2, prefix)) if len(prefix) else None
            own = (columns[shared:].nonzero().squeeze(1) + shared).to(keys.device)
            caches.append(RowCache(keys[:, row].index_select(-1, own), values[:, row].index_select(-2, own), position,
                                   self.prefixes.get(group) if shared else None))
        return caches

    @torch.inference_mode()
    @_without_cpu_autocast
    def resume(self, caches: list[RowCache | None], new_ids: torch.Tensor, new_mask: torch.Tensor,
               new_tokens: int, max_rows: int = 0) -> torch.Tensor:
        """Rebuild the cache from exported rows and run each row's new tokens on top (a prefill that
        starts from a cache): the next turn of an episode without re-reading its earlier turns.

        Layout: the rows' shared prefixes right-aligned in columns ``[0, P)`` (P: the longest, in
        whole 16-column tiles when rows share one), their own packed columns right-aligned in
        ``[P, W)``, then the new tokens right-aligned in ``[W, W + M)``; the columns a row leaves
        empty are holes (key bias -inf, dropped again by ``export``), and position ids run on from
        each row's ``position``, so padding and holes shift nothing. Rows whose caches refer to the
        same ``SharedPrefix`` share columns ``[0, P)`` (``kernels.Sharing``): a decode step reads
        them once for the group, as after ``prefill`` and ``select``. A row without a cache (None)
        is a plain left-padded prompt.

        Args:
            caches: n ``RowCache`` or None. new_ids: (n, M) long, right-aligned. new_mask: (n, M)
            bool, True = real token (each row has at least one). new_tokens: tokens to be decoded
            after (capacity). max_rows: as in ``prefill``.

        Returns:
            (n, V) float32 next-token logits.
        """
        n, M = new_ids.shape
        L, K, D = len(self.layers), self.kv_heads, self.head_dim
        device, dtype = self.embed.device, self.embed.dtype
        prefixes = [None if cache is None else cache.prefix for cache in caches]
        group_of, firsts = [], {}  # rows that refer to the same prefix object: one group, named by its first row
        for row, prefix in enumerate(prefixes):
            group_of.append(row if prefix is None else firsts.setdefault(id(prefix), row))
        prefix_widths = torch.tensor([0 if prefix is None else prefix.keys.shape[-1] for prefix in prefixes], device=device)
        own_widths = torch.tensor([0 if cache is None else cache.keys.shape[-1] for cache in caches], device=device)
        P = int(prefix_widths.max())
        sharing = len(firsts) < sum(prefix is not None for prefix in prefixes)
        if sharing:  # the kernels read a group's shared columns from its first row in whole tiles of 16
            P = -(-P // 16) * 16
        W = P + int(own_widths.max())
        capacity = -(-(W + M + new_tokens) // 16) * 16  # the kernels read keys 16 columns at a time
        self.buffer = torch.empty(L, 2, max(n, max_rows), K, capacity, D, dtype=dtype, device=device)
        self.kv = self.buffer[:, :, :n]
        keys, values = self.kv[:, 0].view(L, n, K, D, capacity), self.kv[:, 1]
        self.key_bias = torch.zeros(n, capacity, dtype=dtype, device=device)
        if W > 0:  # holes are zeros: masked, but still multiplied by 0
            keys[..., :W].zero_()
            values[:, :, :, :W].zero_()
            for row, (cache, prefix) in enumerate(zip(caches, prefixes)):
                if prefix is not None:
                    width = prefix.keys.shape[-1]
                    keys[:, row, :, :, P - width:P], values[:, row, :, P - width:P] = prefix.keys, prefix.values
                if cache is not None:
                    width = cache.keys.shape[-1]
                    keys[:, row, :, :, W - width:W], values[:, row, :, W - width:W] = cache.keys, cache.values
            columns = torch.arange(W, device=device)[None, :]
            holes = (columns < P - prefix_widths[:, None]) | ((columns >= P) & (columns < W - own_widths[:, None]))
            self.key_bias[:, :W].masked_fill_(holes, float("-inf"))
        self.key_bias[:, W:W + M].masked_fill_(~new_mask, float("-inf"))
        starts = torch.tensor([0 if cache is None else cache.position for cache in caches], device=device)
        position_ids = starts[:, None] + (new_mask.long().cumsum(-1) - 1).clamp(min=0)  # (n, M)
        self.positions = position_ids[:, -1] + 1
        self.column = W + M
        cos, sin_signed = self._cos_sin(position_ids)  # (n, M, 1, D)
        # Query i (column W + i) sees the unmasked columns up to its own; the diagonal keeps padding rows finite.
        columns = torch.arange(W + M, device=device)
        causal = columns[None, :] <= (W + torch.arange(M, device=device))[:, None]  # (M, W + M)
        allowed = (causal & (self.key_bias[:, None, :W + M] == 0)) | (columns[None, :] == W + torch.arange(M, device=device)[:, None])
        bias = torch.zeros(n, 1, 1, M, W + M, dtype=dtype, device=device).masked_fill_(~allowed[:, None, None], float("-inf"))
        x = F.embedding(new_ids, self.embed)  # (n, M, d)
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._norm(x, layer.input_norm), cos, sin_signed)  # (n, M, *, D)
            keys[index, :, :, :, W:W + M] = k.permute(0, 2, 3, 1)
            values[index, :, :, W:W + M] = v.transpose(1, 2)
            attn = self._attend(q, keys[index, :, :, :, :W + M], values[index, :, :, :W + M], bias)  # (n * M, H * D)
            x = layer.o.plus(attn, x.reshape(n * M, -1)).view(n, M, -1)
            x = self._mlp(layer, x.view(n * M, -1)).view(n, M, -1)
        self.sharing = kernels.Sharing(group_of, P) if sharing else kernels.Sharing.distinct(n)
        self.prefixes = {group: prefix for group, prefix in zip(group_of, prefixes) if sharing and prefix is not None}
        if self.kernels:
            H, rows = self.heads, max(n, max_rows)
            self.scratch = (torch.empty(rows, H, D), torch.empty(rows, H, capacity), torch.empty(rows, H * D))
        self._make_views()
        return self.lm_head(self._norm(x[:, -1], self.final_norm)).float()

    def _make_views(self) -> None:
        """Per-layer views of the cache, made once per batch change instead of once per step."""
        n, K, S, D = self.kv.shape[2:]
        self.views = [(keys.view(n, K, D, S), values, keys.view(n * K, D, S), values.view(n * K, S, D))
                      for keys, values in (layer.unbind(0) for layer in self.kv.unbind(0))]
        if self.kernels:
            self._make_kernel_args()

    def _make_kernel_args(self) -> None:
        """One ``kernels.AttentionArgs`` per layer for the current rows; decode fills in the rest."""
        n, K, S, D = self.kv.shape[2:]
        if self.scratch[0].shape[0] < n:  # select grew the rows past prefill's max_rows
            self.scratch = tuple(t.new_empty(n, *t.shape[1:]) for t in self.scratch)
        q, scores, out = self.scratch
        self.kernel_args = []
        for layer, (keys, values, _, _) in zip(self.layers, self.views):
            self.kernel_args.append(kernels.AttentionArgs(
                q_norm=None if layer.q_norm is None else layer.q_norm.data_ptr(),
                k_norm=None if layer.k_norm is None else layer.k_norm.data_ptr(),
                eps=self.eps, scale=self.scaling, keys=keys.data_ptr(), values=values.data_ptr(),
                row_stride=keys.stride(0), head_stride=keys.stride(1), S=S,
                key_bias=self.key_bias.data_ptr(), bias_stride=self.key_bias.stride(0),
                group_start=self.sharing.group_start.data_ptr(), members=self.sharing.members.data_ptr(),
                groups=self.sharing.groups, shared=self.sharing.shared,
                H=self.heads, K=K, D=D, q=q.data_ptr(), scores=scores.data_ptr(),
                scores_stride=scores.stride(1), out=out.data_ptr()))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention of M queries per row over c cache columns, for ``resume``. Not
        ``scaled_dot_product_attention``: with a mask and keys stored (D, S) it takes the math path,
        which copies the keys to (S, D) and checks the mask each layer; here the keys are multiplied
        as stored, and the (rep) query heads of a kv head are batched against it, as in ``decode``.

        q: (n, M, H, D); keys: (n, K, D, c); values: (n, K, c, D); bias: (n, 1, 1, M, c), 0 or -inf.
        Returns (n * M, H * D), heads in order."""
        n, M, H, D = q.shape
        K = keys.shape[1]
        rep = H // K
        q = (q * self.scaling).view(n, M, K, rep, D).permute(0, 2, 3, 1, 4).reshape(n, K, rep * M, D)
        scores = torch.matmul(q, keys).view(n, K, rep, M, -1).add_(bias)  # (n, K, rep, M, c)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype).view(n, K, rep * M, -1)
        out = torch.matmul(probs, values).view(n, K, rep, M, D)  # (n, K, rep, M, D)
        return out.permute(0, 3, 1, 2, 4).reshape(n * M, H * D)

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """x + down(silu(gate(h)) * up(h)), h = norm(x). x: (n, d)."""
        gate, up = layer.gate_up(self._norm(x, layer.post_norm)).chunk(2, dim=-1)
        return layer.down.plus(F.silu(gate).mul_(up), x)

    @torch.inference_mode()
    def select(self, rows: torch.Tensor) -> None:
        """Keep (and reorder, or repeat) cache rows: new row i is old row ``rows[i]``. rows: (n,) long.

        Done in place in the preallocated buffer when possible (a new buffer-sized tensor per
        compaction would pay its page faults again): dropping rows (rows[i] >= i) copies forwards,
        repeating them (rows[i] <= i) backwards, so no row is overwritten before it is read.
        """
        old, new = rows.tolist(), len(rows)
        rows = rows.to(self.buffer.device)
        forwards = all(j >= i for i, j in enumerate(old))
        if new <= self.buffer.shape[2] and (forwards or all(j <= i for i, j in enumerate(old))):
            order = range(new) if forwards else range(new - 1, -1, -1)
            L, _, R, K, S, D = self.buffer.shape
            keys, values = self.buffer[:, 0].view(L, R, K, D, S), self.buffer[:, 1]
            for i in order:
                if old[i] != i:  # only the columns written so far
                    keys[:, i, :, :, :self.column].copy_(keys[:, old[i], :, :, :self.column])
                    values[:, i, :, :self.column].copy_(values[:, old[i], :, :self.column])
            self.kv = self.buffer[:, :, :new]
        else:
            self.buffer = self.kv = self.kv.index_select(2, rows)
        self.key_bias = self.key_bias.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
        self.sharing = self.sharing.select(old, self.column)
        if len(set(old)) < len(old):  # repeated rows: new groups, named by their old rows
            self.prefixes = {}
        self._make_views()

    @torch.inference_mode()
    @_without_cpu_autocast
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row; return the next-token logits. tokens: (n,) long -> (n, V) float32."""
        n, column = tokens.shape[0], self.column
        H, K, D = self.heads, self.kv_heads, self.head_dim
        cos, sin_signed = self._cos_sin(self.positions)  # (n, 1, D)
        if self.kernels:
            return self._decode_kernels(tokens, cos.contiguous(), sin_signed.contiguous())
        rep = H // K
        # Grouped-query attention without repeating the cache: query heads g*rep .. g*rep+rep-1 share
        # kv head g, so the (n, H) query heads are batched as (n*K, rep) against (n*K, c) keys.
        key_bias = self.key_bias[:, None, None, :column + 1].expand(n, K, 1, column + 1).reshape(n * K, 1, -1)
        x = F.embedding(tokens, self.embed)  # (n, d)
        for layer, (keys, values, flat_keys, flat_values) in zip(self.layers, self.views):
            q, k, v = self._qkv(layer, self._norm(x, layer.input_norm), cos, sin_signed)  # (n, *, D)
            keys[:, :, :, column] = k  # keys (n, K, D, S)
            values[:, :, column] = v  # values (n, K, S, D)
            scores = torch.baddbmm(key_bias, q.reshape(n * K, rep, D), flat_keys[:, :, :column + 1],
                                   alpha=self.scaling)  # (n*K, rep, c)
            attn = torch.bmm(torch.softmax(scores, dim=-1), flat_values[:, :column + 1])  # (n*K, rep, D)
            x = layer.o.plus(attn.view(n, H * D), x)
            x = self._mlp(layer, x)
        self.positions = self.positions + 1
        self.column = column + 1
        return self.lm_head(self._norm(x, self.final_norm)).float()

    def _decode_kernels(self, tokens: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """``decode`` with norms, rope, cache writes, attention and SwiGLU in the C kernels (same result
        to float32 rounding; tests/test_rollout_kernels.py). The loop calls the C functions directly,
        into reused buffers: at 16 rows a layer's non-matmul work is so short that wrappers show."""
        n, column, d, eps = tokens.shape[0], self.column, self.hidden, self.eps
        library = kernels.load()
        norm, attend, swiglu = library.pt_rms_norm, library.pt_decode_attention, library.pt_silu_mul
        out = self.scratch[2][:n]  # attention output (n, H * D), written by `attend`
        h = torch.empty(n, d)  # normed hidden states, input of qkv and of gate|up
        m = self.layers[0].gate_up.out_features // 2  # intermediate size
        act = torch.empty(n, m)  # silu(gate) * up, input of down
        x = F.embedding(tokens, self.embed)  # (n, d)
        for layer, args in zip(self.layers, self.kernel_args):
            norm(x.data_ptr(), layer.input_norm.data_ptr(), h.data_ptr(), n, d, eps)
            qkv = layer.qkv(h)  # (n, (H + 2K) * D)
            args.qkv, args.cos, args.sin, args.column = qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), column
            attend(ctypes.byref(args))
            x = layer.o.plus(out, x)
            norm(x.data_ptr(), layer.post_norm.data_ptr(), h.data_ptr(), n, d, eps)
            gate_up = layer.gate_up(h)  # (n, 2 * intermediate)
            swiglu(gate_up.data_ptr(), act.data_ptr(), n, m)
            x = layer.down.plus(act, x)
        self.positions = self.positions + 1
        self.column = column + 1
        return self.lm_head(kernels.rms_norm(x, self.final_norm, eps)).float()
