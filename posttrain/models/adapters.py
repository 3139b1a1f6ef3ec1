"""LoRA through peft, the reference model, and the critic (a value head on a causal LM backbone)."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from posttrain.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class LoraSettings:
    """LoRA hyper-parameters (arXiv:2106.09685): W + (alpha / rank) * B A on each target module."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


def apply_lora(model: PreTrainedModel, settings: LoraSettings | None = None) -> PeftModel:
    """Wrap `model` (in place) with fresh LoRA adapters; only the adapters are trainable.
    B starts at zero, so the wrapped model's outputs equal the base model's until the first step."""
    settings = settings or LoraSettings()
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as error:
        raise UserError(f"lora: {error}".splitlines()[0]) from error


def is_lora(model) -> bool:
    return isinstance(model, PeftModel)


def merge_lora(model: PeftModel) -> PreTrainedModel:
    """A plain model with the adapters folded into the weights; `model` itself is left untouched."""
    return copy.deepcopy(model).merge_and_unload()


class ReferenceModel:
    """The frozen reference policy, used only for the KL term (never as the ratio's denominator).

    Either a separate copy of the policy (eval mode, no gradients), or, for a LoRA policy, the policy
    itself run with its adapters disabled: the base weights are the reference, with no second copy
    in memory. Calling it runs a no-grad forward in eval mode and returns the model's output.
    """

    def __init__(self, model, *, adapter_disabled: bool):
        self.model = model
        self.adapter_disabled = adapter_disabled
        self.refreshes = 0

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Forward (N, L) ids; returns the causal LM output (`.logits` is (N, L, V))."""
        with torch.no_grad():
            if not self.adapter_disabled:
                return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            was_training = self.model.training
            self.model.eval()  # the policy may be training (LoRA dropout); the reference never is
            try:
                with self.model.disable_adapter():
                    return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            finally:
                self.model.train(was_training)

    def refresh(self, policy) -> None:
        """Copy the policy's current weights into the reference (record when you do this)."""
        if self.adapter_disabled:
            raise UserError("reference: a LoRA reference is the base model with adapters off; it cannot be refreshed")
        self.model.load_state_dict(policy.state_dict())
        self.refreshes += 1


def make_reference(policy) -> ReferenceModel:
    """The reference for `policy`: adapters disabled for a LoRA policy, else a frozen deep copy."""
    if is_lora(policy):
        return ReferenceModel(policy, adapter_disabled=True)
    frozen = copy.deepcopy(policy).eval().requires_grad_(False)
    return ReferenceModel(frozen, adapter_disabled=False)


class ValueHead(torch.nn.Module):
    """One linear layer from hidden size H to a scalar value per token. Starts at zero (weight and
    bias), so the first values are 0 and early value losses do not disturb a shared backbone."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, L, H) -> (N, L) values, float32."""
        return self.linear(hidden_states.to(self.linear.weight.dtype)).squeeze(-1).float()


class Critic(torch.nn.Module):
    """V(s_t) for PPO: a value head on a causal LM backbone's last hidden state.

    shares_backbone=True: the backbone is the policy itself; it is not registered as a submodule,
    so `critic.parameters()` is only the value head (optimise policy + head, each once).
    shares_backbone=False: the critic owns a separate backbone and everything is its parameters.
    Values at position t are read from the hidden state of token t (the state after that token).
    """

    def __init__(self, backbone, *, shares_backbone: bool):
        super().__init__()
        self.shares_backbone = shares_backbone
        if shares_backbone:
            self.__dict__["backbone"] = backbone  # not a submodule: the policy owns these weights
        else:
            self.backbone = backbone
        hidden_size = backbone.config.hidden_size
        self.value_head = ValueHead(hidden_size).to(next(backbone.parameters()).device)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """(N, L) ids -> (N, L) values (no lm_head computed)."""
        decoder = self.backbone.get_decoder()
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        return self.value_head(hidden)

    def values_from_hidden(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(N, L, H) -> (N, L) values, for a shared backbone whose policy forward already ran with
        `output_hidden_states=True` (use `output.hidden_states[-1]`, the final-norm output)."""
        return self.value_head(hidden_states)


def make_critic(policy, *, share_backbone: bool = False) -> Critic:
    """A critic on the policy's backbone (shared) or on a trainable deep copy of it (separate).
    A separate copy of a LoRA policy keeps LoRA: the critic trains its own adapters and head."""
    if share_backbone:
        return Critic(policy, shares_backbone=True)
    backbone = copy.deepcopy(policy)
    if not is_lora(backbone):
        backbone.requires_grad_(True)
    return Critic(backbone.train(policy.training), shares_backbone=False)
