"""Checkpoints reload with plain transformers; LoRA reference = base; critic values; refresh."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import UserError
from posttrain.models import (
    LoraSettings,
    apply_lora,
    build_tiny_model,
    load_critic,
    load_model,
    make_critic,
    make_reference,
    save_critic,
    save_model,
)

TOKENS = torch.randint(4, 101, (3, 12), generator=torch.Generator().manual_seed(0))
ATTENTION = torch.ones_like(TOKENS)


def small_model(seed=0):
    return build_tiny_model(seed=seed, num_hidden_layers=2)


def perturb_lora(model, seed=1):
    """LoRA B starts at zero; give the adapters non-zero weights so they change the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)


def test_checkpoint_reloads_with_plain_transformers(tmp_path):
    model, tokenizer = small_model()
    save_model(model, tokenizer, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert torch.equal(model(TOKENS).logits, reloaded(TOKENS).logits)
    tokenizer_again = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tokenizer_again.chat_template == tokenizer.chat_template
    text = "x = [1, 2]\nprint(x)"
    assert tokenizer_again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (tokenizer_again.pad_token_id, tokenizer_again.eos_token_id) == (0, 2)
    via_spec, _ = load_model(str(tmp_path / "ckpt"))
    assert torch.equal(model(TOKENS).logits, via_spec(TOKENS).logits)


def test_lora_reference_is_the_base_model_and_adapter_round_trips(tmp_path):
    """Adapters at init leave the logits unchanged (B = 0); once they are non-zero the policy moves
    but the reference (adapters disabled) still equals the untouched base model exactly."""
    base, tokenizer = small_model()
    base_logits = base(TOKENS).logits
    policy = apply_lora(base, LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    assert torch.equal(policy(input_ids=TOKENS).logits, base_logits)
    trainable = [name for name, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    perturb_lora(policy)
    policy.train()
    policy_logits = policy(input_ids=TOKENS).logits
    assert not torch.allclose(policy_logits, base_logits)
    reference = make_reference(policy)
    reference_logits = reference(TOKENS, ATTENTION).logits
    assert torch.equal(reference_logits, base_logits) and not reference_logits.requires_grad
    assert policy.training  # the reference restored the policy's mode
    with pytest.raises(UserError, match="cannot be refreshed"):
        reference.refresh(policy)

    save_model(policy, tokenizer, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    # The adapter names its base spec ("tiny"); reload it over a 2-layer base by hand, and via a
    # merged checkpoint that plain transformers loads.
    save_model(policy, tokenizer, tmp_path / "merged", merge_lora_weights=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(merged(TOKENS).logits, policy_logits, atol=1e-5)
    assert policy(input_ids=TOKENS).logits.equal(policy_logits)  # merging worked on a copy


def test_adapter_directory_loads_through_load_model(tmp_path):
    base, tokenizer = load_model("tiny")
    policy = apply_lora(base, LoraSettings(rank=2, alpha=4))
    perturb_lora(policy, seed=3)
    expected = policy(input_ids=TOKENS).logits
    save_model(policy, tokenizer, tmp_path / "adapter")
    reloaded, _ = load_model(str(tmp_path / "adapter"))
    assert torch.allclose(reloaded(input_ids=TOKENS).logits, expected, atol=1e-6)


def test_frozen_copy_reference_and_refresh():
    policy, _ = small_model()
    reference = make_reference(policy)
    assert all(not p.requires_grad for p in reference.model.parameters())
    assert all(p.requires_grad for p in policy.parameters())
    with torch.no_grad():
        policy.lm_head.weight.add_(0.05)
    assert not torch.equal(reference(TOKENS).logits, policy(TOKENS).logits)
    reference.refresh(policy)
    assert torch.equal(reference(TOKENS).logits, policy(TOKENS).logits) and reference.refreshes == 1


def test_critic_shared_and_separate(tmp_path):
    """Values start at 0 (zero-initialised head) with shape (N, L); shared critics own only the
    head; the hidden-state shortcut agrees with the critic's own forward; save/load round-trips."""
    policy, _ = small_model()
    shared = make_critic(policy, share_backbone=True)
    assert [name for name, _ in shared.named_parameters()] == ["value_head.linear.weight", "value_head.linear.bias"]
    values = shared(TOKENS, ATTENTION)
    assert values.shape == (3, 12) and torch.equal(values, torch.zeros(3, 12))
    with torch.no_grad():
        shared.value_head.linear.weight.normal_(generator=torch.Generator().manual_seed(0))
    hidden = policy(input_ids=TOKENS, output_hidden_states=True).hidden_states[-1]
    assert torch.allclose(shared.values_from_hidden(hidden), shared(TOKENS, ATTENTION), atol=1e-6)
    shared(TOKENS).sum().backward()
    assert policy.model.layers[0].mlp.up_proj.weight.grad is not None  # gradients reach the backbone

    separate = make_critic(policy, share_backbone=False)
    assert separate.backbone is not policy
    assert sum(p.numel() for p in separate.parameters()) == sum(p.numel() for p in policy.parameters()) + 257
    with torch.no_grad():
        separate.value_head.linear.bias.fill_(0.5)
    save_critic(separate, tmp_path / "critic")
    again = load_critic(tmp_path / "critic")
    assert torch.allclose(again(TOKENS), separate(TOKENS))
    save_critic(shared, tmp_path / "shared")
    assert torch.equal(load_critic(tmp_path / "shared", policy=policy)(TOKENS), shared(TOKENS))
    with pytest.raises(UserError, match="pass the policy"):
        load_critic(tmp_path / "shared")
