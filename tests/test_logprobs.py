"""Chunked log-probs against the naive full log-softmax, with temperature, shift and masks."""

import math

import pytest
import torch

from posttrain.algorithms import head_logprobs, response_logprobs, sequence_logprobs, token_logprobs
from posttrain.algorithms.logprobs import _HeadLogprobs, head_scores


@pytest.mark.parametrize("chunk_size", [1, 5, 64, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_chunked_equals_naive_log_softmax(chunk_size, temperature):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 9, 37, generator=generator) * 4
    targets = torch.randint(0, 37, (3, 9), generator=generator)
    naive = torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    chunked = token_logprobs(logits, targets, temperature=temperature, chunk_size=chunk_size)
    assert chunked.shape == (3, 9) and chunked.dtype == torch.float32
    assert torch.allclose(chunked, naive, atol=1e-5)


def test_gradient_equals_naive_gradient():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 13, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (4, 6), generator=generator)
    weights = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    (chunked_grad,) = torch.autograd.grad((token_logprobs(logits, targets, 0.8, chunk_size=5) * weights).sum(), logits)
    naive = torch.log_softmax(logits / 0.8, -1).gather(-1, targets[..., None]).squeeze(-1)
    (naive_grad,) = torch.autograd.grad((naive * weights).sum(), logits)
    assert torch.allclose(chunked_grad, naive_grad, atol=1e-12)


def test_hand_computed_two_token_vocabulary():
    """logits [ln 0.8, ln 0.2] -> log p(token 1) = ln 0.2; at temperature 2 the distribution is
    proportional to [sqrt(0.8), sqrt(0.2)] = [2/3, 1/3] after normalising, so log p(1) = ln(1/3)."""
    logits = torch.tensor([[math.log(0.8), math.log(0.2)]], dtype=torch.float64)
    assert token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.2))
    assert token_logprobs(logits, torch.tensor([1]), temperature=2.0).item() == pytest.approx(math.log(1 / 3))


def test_bfloat16_logits_are_upcast_and_bad_arguments_rejected():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    targets = torch.zeros(2, 3, dtype=torch.long)
    assert token_logprobs(logits, targets).dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="align"):
        token_logprobs(logits, targets[:, :2])


def test_response_logprobs_shift_and_mask_and_sequence_sum():
    """Sequence [p0 p1 r0 r1 EOS pad]: the mask is True on r0 r1 EOS. After the shift, position t
    scores input_ids[t + 1], so positions 1, 2, 3 (predicting r0, r1, EOS) count and the sequence
    log-prob is the sum of exactly those three log-probs."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 6, 10, generator=generator, dtype=torch.float64)
    input_ids = torch.tensor([[4, 5, 6, 7, 2, 0]])
    mask = torch.tensor([[False, False, True, True, True, False]])
    logprobs, shifted_mask = response_logprobs(logits, input_ids, mask)
    assert shifted_mask.tolist() == [[False, True, True, True, False]]
    full = torch.log_softmax(logits, -1)
    expected = full[0, 1, 6] + full[0, 2, 7] + full[0, 3, 2]
    assert logprobs[0, 0].item() == 0.0 and logprobs[0, 4].item() == 0.0
    assert sequence_logprobs(logprobs, shifted_mask).item() == pytest.approx(expected.item())


@pytest.mark.parametrize("chunk_size", [1, 3, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_head_logprobs_equal_the_head_and_log_softmax(chunk_size, bias):
    """The chunked LM-head log-probs (logits recomputed in backward) against head(hidden) +
    log_softmax: values, and gradients w.r.t. the hidden states, the weight and the bias."""
    generator = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(8, 29, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(29, 8, generator=generator))
        if bias:
            head.bias.copy_(torch.randn(29, generator=generator))
    hidden = torch.randn(7, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 29, (7,), generator=generator)
    upstream = torch.randn(7, generator=generator)  # an arbitrary weighting of the positions
    fused = head_logprobs(hidden, head, targets, chunk_size=chunk_size)
    fused_grads = torch.autograd.grad((fused * upstream).sum(), [hidden, *head.parameters()])
    naive = torch.log_softmax(head(hidden), -1).gather(-1, targets[:, None]).squeeze(-1)
    naive_grads = torch.autograd.grad((naive * upstream).sum(), [hidden, *head.parameters()])
    assert fused.shape == (7,) and fused.dtype == torch.float32
    assert torch.allclose(fused, naive, atol=1e-5)
    for got, expected in zip(fused_grads, naive_grads):
        assert torch.allclose(got, expected, atol=1e-5)


def test_head_logprobs_pass_gradcheck_and_skip_frozen_inputs():
    generator = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(5, 11).double()
    hidden = torch.randn(6, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=generator)
    chunked = lambda h, w, b: _HeadLogprobs.apply(h, w, b, targets, 4)  # noqa: E731 (2 chunks of 4 rows)
    assert torch.autograd.gradcheck(chunked, (hidden, head.weight, head.bias))
    head.requires_grad_(False)  # a frozen head (LoRA): only the hidden states get a gradient
    out = head_logprobs(hidden, head, targets)
    out.sum().backward()
    assert hidden.grad is not None and head.weight.grad is None



@pytest.mark.parametrize("chunk_size", [1, 3, 128])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_head_scores_equal_the_head_log_softmax_and_entropy(chunk_size, temperature, entropy_grad):
    """The fused LM-head log-probs + entropy (probabilities kept, reused in place for backward) against
    head(hidden) then log_softmax and the entropy, in float64: values, and gradients w.r.t. the hidden
    states, the weight and the bias, under an arbitrary weighting of both outputs (the entropy's
    gradient only with `entropy_grad`; else it is detached)."""
    generator = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(8, 29).double()
    with torch.no_grad():
        head.weight.copy_(3 * torch.randn(29, 8, generator=generator))
    hidden = torch.randn(7, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 29, (7,), generator=generator)
    up_logprobs, up_entropy = torch.randn(7, generator=generator), torch.randn(7, generator=generator)
    logprobs, entropy = head_scores(hidden, head, targets, temperature, entropy_grad=entropy_grad, chunk_size=chunk_size)
    assert entropy.requires_grad == entropy_grad and logprobs.dtype == torch.float64
    loss = (logprobs * up_logprobs).sum() + ((entropy * up_entropy).sum() if entropy_grad else 0)
    grads = torch.autograd.grad(loss, [hidden, *head.parameters()])
    log_p = torch.log_softmax(head(hidden) / temperature, -1)
    naive_entropy = -(log_p.exp() * log_p).sum(-1)
    naive_loss = (log_p.gather(-1, targets[:, None]).squeeze(-1) * up_logprobs).sum()
    naive_loss = naive_loss + ((naive_entropy * up_entropy).sum() if entropy_grad else 0)
    naive_grads = torch.autograd.grad(naive_loss, [hidden, *head.parameters()])
    assert torch.allclose(logprobs, log_p.gather(-1, targets[:, None]).squeeze(-1), atol=1e-12)
    assert torch.allclose(entropy, naive_entropy, atol=1e-12)
    for got, expected in zip(grads, naive_grads, strict=True):
        assert torch.allclose(got, expected, atol=1e-10)


def test_head_scores_without_grad_are_the_training_bits_and_keep_nothing():
    """A no-grad pass (old / reference log-probs) gives the same bits as the training forward of the
    same rows (so mu = 1's first ratio is exactly 1), without entropies when not asked for; a second
    backward through one graph is refused by autograd (the saved probabilities were turned into the
    gradient in place)."""
    generator = torch.Generator().manual_seed(6)
    head = torch.nn.Linear(16, 301, bias=False)
    hidden = torch.randn(40, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 301, (40,), generator=generator)
    trained, _ = head_scores(hidden, head, targets, 0.9, chunk_size=16)
    with torch.no_grad():
        plain, none = head_scores(hidden, head, targets, 0.9, chunk_size=16, entropy=False)
    assert torch.equal(trained.detach(), plain) and none is None
    trained.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        trained.sum().backward()
