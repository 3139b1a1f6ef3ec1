"""Training memory: the SwiGLU MLP keeps two of its four wide activations for backward.

A Llama-family MLP computes ``down(silu(gate(x)) * up(x))``. Plain autograd keeps four tensors of the
MLP's width (``intermediate_size``, 2.7x the hidden size in SmolLM2) per token and layer for backward:
``gate(x)`` (for silu), ``silu(gate(x))`` and ``up(x)`` (for the product) and the product (for
``down``'s weight gradient). The last two are cheap elementwise functions of the first two, so
``lean_mlp`` keeps only ``gate(x)`` and ``up(x)`` and recomputes the rest in backward: half the MLP's
saved activations (measured on a SmolLM2 DPO step: docs/models.md), for elementwise work in backward.
The values and gradients are those of the plain forward (tested in tests/test_models_memory.py).

This is not activation checkpointing: no matmul is recomputed.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

MLP_CLASSES = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
"""The MLP classes whose forward is exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


class _SwiGLUDown(torch.autograd.Function):
    """``F.linear(silu(gate) * up, weight, bias)``, saving only ``gate`` and ``up`` (and the weight)."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        kind = gate.device.type
        ctx.compute = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None  # bf16-mixed
        return F.linear(F.silu(gate) * up, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight = ctx.saved_tensors
        if ctx.compute is not None:  # the forward ran under autocast: the backward's matmuls in its dtype
            weight, grad_out = weight.to(ctx.compute), grad_out.to(ctx.compute)
        activated = F.silu(gate)
        grad_product = grad_out @ weight  # (..., I)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[2]:
            product = activated * up
            grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).T @ product.reshape(-1, product.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad_product * activated if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, grad_weight, grad_bias


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up``, saving only ``gate`` and ``up`` (for a ``down_proj`` that is not a plain
    ``nn.Linear``, e.g. a LoRA layer, which then keeps the product itself)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad_out * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def _lean_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if type(self.down_proj) is torch.nn.Linear:
        return _SwiGLUDown.apply(gate, up, self.down_proj.weight, self.down_proj.bias)
    return self.down_proj(_SwiGLU.apply(gate, up))


def lean_mlp(model: torch.nn.Module) -> int:
    """Make every SwiGLU MLP of ``model`` keep only ``gate(x)`` and ``up(x)`` for backward (see the
    module doc). Changes the modules' ``forward`` in place (not their weights or what is saved);
    MLPs of other kinds (another activation, unknown classes) are left alone.

    Args:
        model: a Hugging Face causal LM, a PEFT model around one, or any module containing such MLPs.

    Returns:
        how many MLPs were changed.
    """
    changed = 0
    for module in model.modules():
        if type(module).__name__ not in MLP_CLASSES or getattr(module, "_posttrain_lean", False):
            continue
        if type(getattr(module, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
            continue
        module.forward = types.MethodType(_lean_forward, module)
        module._posttrain_lean = True
        changed += 1
    logger.debug("lean_mlp: %d SwiGLU MLPs keep gate and up only", changed)
    return changed
