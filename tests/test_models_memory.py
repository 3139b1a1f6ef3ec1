"""lean_mlp: the same losses and gradients as the plain MLP, with fewer bytes saved for backward."""

import copy

import pytest
import torch

from posttrain.models import LoraSettings, apply_lora, build_tiny_model
from posttrain.models.memory import lean_mlp

TOKENS = torch.randint(4, 101, (3, 14), generator=torch.Generator().manual_seed(0))


def loss_and_saved_bytes(model) -> tuple[torch.Tensor, int]:
    """A weighted log-likelihood loss of TOKENS, and the bytes of activations autograd saved for its
    backward (weights, and views of them, do not count: they are kept anyway)."""
    saved, weights = [], {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=TOKENS, attention_mask=torch.ones_like(TOKENS)).logits
    position_weights = torch.linspace(0.5, 1.5, TOKENS.shape[1] - 1)
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, TOKENS[:, 1:, None]).squeeze(-1)
    return -(logprobs * position_weights).mean(), sum(saved)


@pytest.mark.parametrize("lora_targets", [None, ["gate_proj", "up_proj", "down_proj", "q_proj"]])
def test_lean_mlp_gives_the_plain_losses_and_gradients_with_less_saved(lora_targets):
    plain, _ = build_tiny_model(seed=1, mlp_bias=True)
    if lora_targets:
        plain = apply_lora(plain, LoraSettings(rank=4, target_modules=lora_targets))
        with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
            for name, parameter in plain.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    lean = copy.deepcopy(plain)
    assert lean_mlp(lean) == 4 and lean_mlp(lean) == 0  # 4 layers; a second call changes nothing
    plain_loss, plain_saved = loss_and_saved_bytes(plain)
    lean_loss, lean_saved = loss_and_saved_bytes(lean)
    plain_loss.backward()
    lean_loss.backward()
    assert torch.equal(plain_loss, lean_loss)
    trained = [(name, a, b) for (name, a), (_, b) in zip(plain.named_parameters(), lean.named_parameters())
               if a.requires_grad]
    assert any("mlp" in name for name, _, _ in trained)
    for name, a, b in trained:
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-5), name
    # Per layer and token the plain MLP keeps gate, silu(gate), up and the product (width I = 688);
    # lean keeps gate and up; a LoRA down_proj keeps the product itself (one width-I tensor more).
    config = build_tiny_model()[0].config
    tokens, per = TOKENS.numel(), config.intermediate_size * 4 * config.num_hidden_layers
    assert plain_saved - lean_saved == (1 if lora_targets else 2) * tokens * per


def test_other_activations_are_left_alone():
    model, _ = build_tiny_model(hidden_act="gelu")
    assert lean_mlp(model) == 0
