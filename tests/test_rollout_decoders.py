"""The fast Llama-family decoder against each architecture's own forward, and the generic fallback."""

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from posttrain.models import build_tiny_tokenizer
from posttrain.rollout import SamplingConfig, generate, kernels
from posttrain.rollout.engine import _left_pad
from posttrain.rollout.hf_decoder import HFDecoder
from posttrain.rollout.llama_decoder import LlamaDecoder, unsupported_reason

SMALL = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
             bos_token_id=None)

ARCHITECTURES = {
    "llama-attention-bias": (LlamaForCausalLM, LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
    "llama-untied-gqa4": (LlamaForCausalLM, LlamaConfig, dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict()),
    "qwen3-qk-norm": (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=32)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(sliding_window=None)),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig, dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
}


def build(name, seed=0):
    model_class, config_class, extra = ARCHITECTURES[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SMALL, **extra}))
    with torch.no_grad():  # random biases and norm weights, so that each of them matters
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("bias") or "norm" in parameter_name:
                parameter.normal_(1.0 if "norm" in parameter_name else 0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_fast_decoder_logits_equal_the_model_forward(name):
    """Prefill two left-padded prompts, copy to G=2 rows each, decode 6 fixed tokens, drop a row half
    way: every step's logits equal the no-cache forward over the same tokens."""
    model = build(name)
    assert unsupported_reason(model, 64) is None
    prompts = [[5, 17, 33, 8, 9, 60, 4], [70, 71, 72]]
    prompt_ids, prompt_mask = _left_pad(prompts, 0, 7)
    steps = torch.randint(4, 101, (4, 6), generator=torch.Generator().manual_seed(0))
    decoder = LlamaDecoder(model)
    logits = [decoder.prefill(prompt_ids, prompt_mask, 7 + 6).repeat_interleave(2, 0)]
    decoder.select(torch.tensor([0, 0, 1, 1]))
    rows = torch.arange(4)
    for step in range(5):
        if step == 3:  # compaction: row 1 leaves
            rows = torch.tensor([0, 2, 3])
            decoder.select(torch.tensor([0, 2, 3]))
        logits.append(torch.zeros(4, 101).index_copy(0, rows, decoder.decode(steps[rows, step])))
    ids = torch.cat([prompt_ids.repeat_interleave(2, 0), steps[:, :5]], 1)
    attention = torch.cat([prompt_mask.repeat_interleave(2, 0), torch.ones(4, 5, dtype=torch.bool)], 1).long()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=attention,
                         position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits[:, 6:]  # (4, 6, V)
    got = torch.stack(logits, 1)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[1, 4:] = False  # row 1 was dropped before steps 3 and 4 (logit columns 4 and 5)
    assert torch.allclose(got[keep], expected[keep], atol=1e-4), (got[keep] - expected[keep]).abs().max()


@pytest.mark.parametrize("name", ["qwen2", "qwen3-qk-norm"])
def test_greedy_equals_generate_on_other_architectures(name):
    model = build(name, seed=1)
    tokenizer = build_tiny_tokenizer()
    prompts = ["Q: 7*6=?", "abc"]
    rollout = generate(model, tokenizer, prompts, sampling=SamplingConfig(greedy=True, max_new_tokens=20),
                       backend="fast")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    prompt_ids, prompt_mask = _left_pad(ids, 0, max(map(len, ids)))
    with torch.no_grad():
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), do_sample=False,
                             max_new_tokens=20, min_new_tokens=20, pad_token_id=0, eos_token_id=None)
    expected = out[:, prompt_ids.shape[1]:]
    for row in range(2):  # up to the first EOS, which generate was told to ignore
        length = int(rollout.lengths[row])
        assert rollout.completion_ids[row, :length].tolist() == expected[row, :length].tolist()


def test_packed_weights_follow_parameter_updates():
    """The packed weights are reused while unchanged, and rebuilt after an in-place update, even one
    through ``.data``, which does not bump a parameter's version counter."""
    model = build("qwen2", seed=2)
    tokenizer = build_tiny_tokenizer()
    sampling = SamplingConfig(greedy=True, max_new_tokens=12)
    before = generate(model, tokenizer, ["hello"], sampling=sampling, backend="fast")
    packed = LlamaDecoder(model).layers
    assert LlamaDecoder(model).layers is packed  # unchanged: reused
    if kernels.load() is not None:  # the kernels' blocked layout serves every batch size
        assert LlamaDecoder(model, batch_hint=1).layers is packed
    onednn = LlamaDecoder(model, use_kernels=False).layers  # oneDNN's layout depends on the batch size
    for_1_row = LlamaDecoder(model, batch_hint=1, use_kernels=False).layers
    assert for_1_row is not onednn and LlamaDecoder(model, batch_hint=1, use_kernels=False).layers is for_1_row
    packed = LlamaDecoder(model).layers
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(0.0)  # a version bump alone also rebuilds
    rebuilt = LlamaDecoder(model).layers
    assert rebuilt is not packed and LlamaDecoder(model).layers is rebuilt
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    fast = generate(model, tokenizer, ["hello"], sampling=sampling, backend="fast")
    generic = generate(model, tokenizer, ["hello"], sampling=sampling, backend="hf")
    assert torch.equal(fast.completion_ids, generic.completion_ids)
    assert torch.allclose(fast.logprobs, generic.logprobs, atol=1e-4)
    assert not torch.equal(fast.logprobs, before.logprobs)


def test_generate_samples_in_eval_mode_and_restores_the_mode():
    model = build("llama-attention-bias")
    model.config.attention_dropout = 0.5  # would change the generic decoder's logits in train mode
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    tokenizer = build_tiny_tokenizer()
    model.train()
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=8)
    fast = generate(model, tokenizer, ["ab", "c"], sampling=sampling, backend="fast")
    generic = generate(model, tokenizer, ["ab", "c"], sampling=sampling, backend="hf")
    assert model.training
    assert torch.equal(fast.completion_ids, generic.completion_ids)
    assert torch.allclose(fast.logprobs, generic.logprobs, atol=1e-4)


def test_other_architectures_fall_back_to_the_generic_decoder():
    """GPT-2 is not Llama-family: 'auto' uses its own forward, and the log-probs still match."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                       bos_token_id=2, eos_token_id=2)).eval()
    tokenizer = build_tiny_tokenizer()
    assert "gpt2" in unsupported_reason(model, 64)
    with pytest.raises(Exception, match="backend 'fast'"):
        generate(model, tokenizer, ["hi"], backend="fast")
    rollout = generate(model, tokenizer, ["hi there", "x"], group_size=2,
                       sampling=SamplingConfig(temperature=0.8, max_new_tokens=10), seed=0)
    inputs = rollout.forward_inputs()
    with torch.no_grad():
        logits = model(**inputs).logits[:, inputs["input_ids"].shape[1] - 11:-1] / 0.8
    expected = torch.log_softmax(logits, -1).gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(rollout.logprobs[rollout.mask], expected[rollout.mask], atol=1e-4)


def test_mistral_sliding_window_shorter_than_the_sequence_is_not_fast():
    model_class, config_class, _ = ARCHITECTURES["mistral"]
    model = model_class(config_class(**{**SMALL, "sliding_window": 16}))
    assert "sliding window" in unsupported_reason(model, 64)
    assert unsupported_reason(model, 16) is None
    assert isinstance(HFDecoder(model), HFDecoder)


def test_dora_adapters_fall_back_to_the_generic_decoder():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(build("qwen2"), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    assert "DoRA" in unsupported_reason(model, 64)


def test_select_with_a_permutation_falls_back_to_a_copy():
    """Rows swapped (neither dropping nor repeating): same logits as prefilling in the swapped order."""
    model = build("qwen2")
    prompt_ids, prompt_mask = _left_pad([[5, 6, 7], [9, 10]], 0, 3)
    swapped = LlamaDecoder(model)
    swapped.prefill(prompt_ids, prompt_mask, 8, max_rows=2)
    swapped.select(torch.tensor([1, 0]))
    direct = LlamaDecoder(model)
    direct.prefill(prompt_ids.flip(0), prompt_mask.flip(0), 8)
    tokens = torch.tensor([11, 12])
    assert torch.allclose(swapped.decode(tokens), direct.decode(tokens), atol=1e-5)
