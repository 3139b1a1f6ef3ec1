"""Shared-prefix forward (each distinct prompt once, KV cache copied to its rows) against the plain
forward over prompt + completion: same log-probs and same parameter gradients, for the tiny Llama
with and without LoRA, left-padded prompts and right-padded completions of different lengths."""

import pytest
import torch

from posttrain.algorithms import token_logprobs
from posttrain.models import apply_lora, load_model, make_reference
from posttrain.models import forward as model_forward
from posttrain.models.forward import completion_logits, completion_logprobs
from posttrain.rollout import Rollout, SamplingConfig

B, G = 3, 3
PROMPT_LENGTHS = [5, 9, 2]  # P = 9: prompts 0 and 2 are left-padded
COMPLETION_LENGTHS = [6, 1, 4, 6, 3, 2, 5, 6, 1]  # T = 6, per row b*G + g


def make_rollout(vocab_size: int, pad: int = 0) -> Rollout:
    """B groups of G rows: row b*G + g has prompt b (shared) and its own completion."""
    generator = torch.Generator().manual_seed(0)
    P, T, N = max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS), B * G
    prompt_ids = torch.full((N, P), pad)
    prompt_mask = torch.zeros(N, P, dtype=torch.bool)
    completion_ids = torch.full((N, T), pad)
    mask = torch.zeros(N, T, dtype=torch.bool)
    for b, length in enumerate(PROMPT_LENGTHS):
        prompt = torch.randint(3, vocab_size, (length,), generator=generator)
        prompt_ids[b * G : (b + 1) * G, P - length :] = prompt
        prompt_mask[b * G : (b + 1) * G, P - length :] = True
    for row, length in enumerate(COMPLETION_LENGTHS):
        completion_ids[row, :length] = torch.randint(3, vocab_size, (length,), generator=generator)
        mask[row, :length] = True
    zeros = torch.zeros(N, T)
    return Rollout(
        prompt_ids=prompt_ids, prompt_attention_mask=prompt_mask, completion_ids=completion_ids, mask=mask,
        sampler_logprobs=zeros, logprobs=zeros, finished=torch.ones(N, dtype=torch.bool),
        truncated=torch.zeros(N, dtype=torch.bool), texts=[""] * N, prompt_index=torch.arange(B).repeat_interleave(G),
        group_size=G, sampling=SamplingConfig(), pad_token_id=pad,
    )


def plain_logits(model, inputs, rows, P, T):
    """The reference: the full forward over every position, sliced to the completion."""
    output = model(input_ids=inputs["input_ids"][rows], attention_mask=inputs["attention_mask"][rows],
                   position_ids=inputs["position_ids"][rows])
    return output.logits[:, P - 1 : P - 1 + T]


def tiny_lora():
    """A LoRA tiny model whose adapters are not zero (B starts at 0: perturb it so LoRA matters)."""
    model = apply_lora(load_model("tiny")[0])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


ROWS = {
    "all": slice(0, B * G),
    "two whole groups": torch.tensor([3, 4, 5, 6, 7, 8]),
    "partial groups, shuffled": torch.tensor([7, 0, 2, 8, 4]),
    "no shared prompt": torch.tensor([0, 3, 6]),
}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("rows", list(ROWS.values()), ids=list(ROWS))
def test_logprobs_and_gradients_match_plain_forward(lora, rows):
    """log-probs of the completion tokens (atol 1e-5) and d(sum of weighted log-probs)/d(params)."""
    model = tiny_lora() if lora else load_model("tiny")[0]
    model.train()
    rollout = make_rollout(model.config.vocab_size)
    inputs = rollout.forward_inputs()
    P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    completion_ids, mask = rollout.completion_ids[rows], rollout.mask[rows]
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view(mask.shape)  # distinct per token, like advantages
    results = []
    for forward in (plain_logits, lambda *a: completion_logits(*a)[1]):
        model.zero_grad(set_to_none=True)
        logprobs = token_logprobs(forward(model, inputs, rows, P, T), completion_ids, 1.0)
        (logprobs * weights * mask).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        results.append((logprobs.detach(), grads))
    (plain, plain_grads), (shared, shared_grads) = results
    torch.testing.assert_close(shared[mask], plain[mask], atol=1e-5, rtol=0)
    assert plain_grads.keys() == shared_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_each_distinct_prompt_is_embedded_once():
    """All 9 rows: 3 prompts x P=9 positions, then 9 rows x (T-1)=5 completion positions."""
    model, _ = load_model("tiny")
    rollout = make_rollout(model.config.vocab_size)
    shapes = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: shapes.append(tuple(args[0].shape)))
    completion_logits(model, rollout.forward_inputs(), slice(0, B * G), 9, 6)
    assert shapes == [(3, 9), (9, 5)]


def test_reference_and_no_grad_logprobs_match():
    """`logprobs_of` (micro-batches of 4: groups split across them) under a LoRA reference."""
    policy = tiny_lora()
    reference = make_reference(policy)
    rollout = make_rollout(policy.config.vocab_size)
    inputs = rollout.forward_inputs()
    P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    for model in (policy, reference):
        with torch.no_grad():
            expected = token_logprobs(plain_logits(model, inputs, slice(None), P, T), rollout.completion_ids, 1.0)
        got = completion_logprobs(model, rollout, inputs, 1.0, micro_batch_size=4)
        torch.testing.assert_close(got[rollout.mask], expected[rollout.mask], atol=1e-5, rtol=0)
        assert bool((got[~rollout.mask] == 0).all())


def test_extra_arguments_and_unsupported_models_take_the_plain_path(monkeypatch):
    """PPO-style `output_hidden_states` keeps the full output; an unknown model_type is not tried."""
    model, _ = load_model("tiny")
    rollout = make_rollout(model.config.vocab_size)
    inputs = rollout.forward_inputs()
    output, logits = completion_logits(model, inputs, slice(0, 6), 9, 6, output_hidden_states=True)
    assert output.logits.shape[1] == 15 and len(output.hidden_states) == 5
    torch.testing.assert_close(logits, plain_logits(model, inputs, slice(0, 6), 9, 6))
    monkeypatch.setattr(model_forward, "SUPPORTED_MODEL_TYPES", ())
    assert model_forward.shared_prefix_logits(model, inputs, slice(0, 6), 9, 6) is None
    output, logits = completion_logits(model, inputs, slice(0, 6), 9, 6)
    assert output is not None
    torch.testing.assert_close(logits, plain_logits(model, inputs, slice(0, 6), 9, 6))
