"""The fast decoder's copy of the weights: fused, LoRA-folded, laid out for the matmul kernel in use.

``build_layers(model, batch_hint)`` reads a Llama-family model (plain or PEFT LoRA) and returns one
``Layer`` per decoder layer plus the LM head, with q|k|v and gate|up concatenated and every active
LoRA adapter folded in (W + B @ A * scaling; the model is not touched). The copy is cached per
model and rebuilt only when a weight changes (see ``weights_fingerprint``) or the layout does;
``release(model)`` drops it (``generate`` does so when it returns on a GPU, where the copy would
otherwise stay allocated through the update that follows). Layouts:

* "blocked" for our C linear kernel (``posttrain.rollout.kernels``), on CPU float32 when it builds;
* "onednn", prepacked for oneDNN for a batch size, on CPU float32 otherwise;
* "plain" (``F.linear``) on other devices and dtypes.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.rollout import kernels

logger = logging.getLogger(__name__)

PACKED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (its LoRA layers stay in place), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def linear_problem(module: torch.nn.Module) -> str | None:
    """None if ``module`` is a plain ``nn.Linear`` or a PEFT LoRA ``Linear`` whose active adapters can
    be folded into one weight; else why not (DoRA, LoRA biases, other wrappers)."""
    if type(module) is torch.nn.Linear:
        return None
    if type(getattr(module, "base_layer", None)) is not torch.nn.Linear or not hasattr(module, "get_delta_weight"):
        return f"layer of type {type(module).__name__} is neither nn.Linear nor a PEFT LoRA Linear"
    if module.merged and module.disable_adapters:  # PEFT's forward would first unmerge in place
        return "a merged LoRA layer with adapters disabled"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out LoRA"
    for name in module.active_adapters:
        if name in getattr(module, "lora_variant", {}) or module.use_dora.get(name) or module.lora_bias.get(name):
            return f"LoRA adapter {name!r} is DoRA or has a bias"
    return None


def linear_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) that a supported ``module`` applies, in the base layer's dtype; LoRA adapters
    folded in (W + B @ A * scaling, computed here in float32: the model is not changed)."""
    if type(module) is torch.nn.Linear:
        return module.weight.detach(), module.bias
    base = module.base_layer.weight.detach()
    weight = base.float()  # adapters (float32 even on a bf16 base, PEFT's default) folded in float32
    if not (module.disable_adapters or module.merged):
        for name in module.active_adapters:
            if name in module.lora_A:
                weight = weight + module.get_delta_weight(name).float()
    return weight.to(base.dtype), module.base_layer.bias


def projections(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


class Linear:
    """``y = x @ weight.T + bias``, with the residual add fused (``plus``). Weight layouts:

    * "blocked": our C kernel (``kernels.linear``), when the kernels build here (CPU, float32);
    * "onednn": prepacked for oneDNN for a batch size, on CPU float32 without the kernels;
    * "plain": ``F.linear`` (other devices and dtypes).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, layout: str, batch_hint: int):
        self.layout = layout
        self.bias = None if bias is None else bias.contiguous()
        self.out_features = weight.shape[0]
        if layout == "blocked":
            self.weight = kernels.pack_blocked(weight)
        elif layout == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "blocked":
            return kernels.linear(x, self.weight, self.out_features, self.bias)
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def plus(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if self.layout == "blocked":
            return kernels.linear(x, self.weight, self.out_features, self.bias, add=other)
        if self.layout == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias).add_(other)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate|up: (n, d) -> (n, 2 * intermediate)
    down: Linear


def cat_biases(*linears: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor | None:
    """The bias of the concatenated (weight, bias) pairs: None if none has one, else zeros fill in."""
    if all(bias is None for _, bias in linears):
        return None
    return torch.cat([bias if bias is not None else weight.new_zeros(weight.shape[0]) for weight, bias in linears])


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        probe = torch.ops.mkldnn._reorder_linear_weight(weight[:8, :8].contiguous(), 2)
        torch.ops.mkldnn._linear_pointwise(weight.new_ones(2, 8), probe, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def weights_fingerprint(model: torch.nn.Module) -> tuple:
    """Changes whenever a parameter does, including through ``param.data`` (see the module doc)."""
    with torch.no_grad():
        adapters = tuple((m.disable_adapters, m.merged, tuple(m.active_adapters))
                         for m in model.modules() if hasattr(m, "get_delta_weight"))  # PEFT LoRA switches
        parameters = list(model.parameters())
        sums = torch.stack([p.sum(dtype=torch.float32) for p in parameters]).tolist() if parameters else []  # one sync on a GPU
        return tuple((p.data_ptr(), p._version, total) for p, total in zip(parameters, sums)) + adapters


class WeightSyncs:
    """The bookkeeping of an engine that holds weights of its own (`VLLMEngine`, `WorkerEngine`):
    which model's weights, by `weights_fingerprint`, it holds, and what syncing them has cost. An
    engine calls `init_syncs` once, asks `holds` before sending, and `record_sync` after."""

    last_sync_s: float | None
    """Seconds the last weight sync took (None: the call before found the weights unchanged)."""
    syncs: int
    """Weight syncs so far (the first load counts)."""
    sync_seconds: float
    """Seconds of every weight sync so far, the first load included (the recipe logs its growth over a step: `rollout/sync_s`)."""

    def init_syncs(self) -> None:
        self._synced: tuple | None = None
        self._synced_model = None
        self.last_sync_s, self.syncs, self.sync_seconds = None, 0, 0.0

    def holds(self, model, fingerprint: tuple) -> bool:
        """Whether the engine holds `model`'s weights as they are (`fingerprint`: `weights_fingerprint(model)`)."""
        return self._synced_model is model and fingerprint == self._synced

    def record_sync(self, model, fingerprint: tuple, started: float) -> float:
        """The engine now holds `model`'s weights (`fingerprint`), sent since `started` (a
        `time.perf_counter()`); returns the seconds it took, counted in `syncs` and `sync_seconds`."""
        self._synced, self._synced_model = fingerprint, model
        seconds = time.perf_counter() - started
        self.syncs += 1
        self.sync_seconds += seconds
        return seconds

    def forget_weights(self) -> None:
        """The engine holds no known weights any more (its process is gone): the next call sends them."""
        self._synced = self._synced_model = None


def layout_for(weight: torch.Tensor, use_kernels: bool) -> str:
    """The ``Linear`` layout for a model whose weights look like ``weight``."""
    if use_kernels and kernels.usable(weight):
        return "blocked"
    return "onednn" if can_pack(weight) else "plain"


def release(model: torch.nn.Module) -> None:
    """Forget ``model``'s weight copy, freeing its memory now; the next ``build_layers`` makes a new one."""
    PACKED.pop(model, None)


def build_layers(model: torch.nn.Module, batch_hint: int, use_kernels: bool = True,
                 dtype: torch.dtype | None = None) -> tuple[list[Layer], Linear]:
    """Fuse and (on CPU) pack the weights; reused while the weights and the layout are unchanged.
    `dtype`: keep the copy in this dtype (bf16 for a bf16-mixed rollout on a GPU; None: the model's).

    oneDNN lays its packed weights out for a batch size, and decoding 16 rows with weights packed
    for 1 row is much slower (docs/rollout.md), so with oneDNN a different hint repacks.
    The kernels' blocked layout serves every batch size."""
    core = unwrap(model)
    head = core.get_output_embeddings().weight
    cast = (lambda weight: weight.to(dtype)) if dtype is not None and dtype != head.dtype else (lambda weight: weight)
    layout = layout_for(cast(head[:1]), use_kernels)
    fingerprint = (weights_fingerprint(model), layout, batch_hint if layout == "onednn" else None, dtype)
    cached = PACKED.get(model)
    if cached is not None and cached[0] == fingerprint:
        return cached[1], cached[2]
    PACKED.pop(model, None)  # free the stale copy before making the new one
    layers = []
    with torch.no_grad():
        head_weight, head_bias = linear_weights(core.get_output_embeddings())
        for layer in core.model.layers:
            (q, q_bias), (k, k_bias), (v, v_bias), (o, o_bias), (gate, gate_bias), (up, up_bias), (down, down_bias) = (
                (cast(weight), None if bias is None else cast(bias)) for weight, bias in map(linear_weights, projections(layer)))
            q_norm = getattr(layer.self_attn, "q_norm", None)
            k_norm = getattr(layer.self_attn, "k_norm", None)
            layers.append(Layer(
                input_norm=cast(layer.input_layernorm.weight.detach()),
                qkv=Linear(torch.cat([q, k, v]), cat_biases((q, q_bias), (k, k_bias), (v, v_bias)), layout,
                           batch_hint),
                q_norm=None if q_norm is None else cast(q_norm.weight.detach()),
                k_norm=None if k_norm is None else cast(k_norm.weight.detach()),
                o=Linear(o, o_bias, layout, batch_hint),
                post_norm=cast(layer.post_attention_layernorm.weight.detach()),
                gate_up=Linear(torch.cat([gate, up]), cat_biases((gate, gate_bias), (up, up_bias)), layout, batch_hint),
                down=Linear(down, down_bias, layout, batch_hint),
            ))
        lm_head = Linear(cast(head_weight), None if head_bias is None else cast(head_bias), layout, batch_hint)
    logger.debug("fast decoder: %d layers prepared (%s weights)", len(layers), layout)
    PACKED[model] = (fingerprint, layers, lm_head)
    return layers, lm_head
