"""models.packing: sequences packed into one row without padding, attention per sequence on a
padded view. Checked against each sequence's own forward, in value and gradient."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from posttrain.models.packing import NAME, PackedLayout, use_packed_attention


def small_decoder(attention: str = "sdpa") -> LlamaModel:
    """A random 2-layer Llama decoder with grouped-query attention (4 query heads, 2 key/value heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = attention
    return LlamaModel(config).float()


def test_layout_by_hand():
    """Lengths 2 and 3 in a (2, 3) padded view: slot (0, 2) is padding and reads position 0; the
    packed positions 0..4 sit in slots 0, 1, 3, 4, 5; the padding query sees itself only."""
    causal = torch.ones(3, 3, dtype=torch.bool).tril().expand(2, 3, 3)
    layout = PackedLayout.of(torch.tensor([2, 3]), causal)
    assert layout.gather.tolist() == [0, 1, 0, 2, 3, 4]
    assert layout.scatter.tolist() == [0, 1, 3, 4, 5]
    assert layout.masks.shape == (2, 1, 3, 3)
    assert layout.masks[0, 0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    assert layout.masks[1, 0].tolist() == causal[1].tolist()


def test_packed_forward_equals_each_sequence_alone_in_value_and_gradient():
    """Three sequences of 5, 2 and 7 tokens packed in one row of 14 (positions counting from 0 in
    each) under causal masks: the hidden states and every parameter's gradient equal the three
    sequences' separate forwards."""
    decoder = small_decoder()
    lengths = [5, 2, 7]
    sequences = [torch.randint(0, 50, (length,), generator=torch.Generator().manual_seed(length)) for length in lengths]
    weights = [torch.randn(length, 32, generator=torch.Generator().manual_seed(10 + length)) for length in lengths]

    decoder.zero_grad()
    alone = [decoder(input_ids=ids[None]).last_hidden_state[0] for ids in sequences]
    sum((hidden * weight).sum() for hidden, weight in zip(alone, weights)).backward()
    expected = {name: parameter.grad.clone() for name, parameter in decoder.named_parameters()}

    assert use_packed_attention(decoder) and decoder.config._attn_implementation == NAME
    W = max(lengths)
    layout = PackedLayout.of(torch.tensor(lengths), torch.ones(W, W, dtype=torch.bool).tril().expand(len(lengths), W, W))
    decoder.zero_grad()
    packed = decoder(input_ids=torch.cat(sequences)[None], position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                     attention_mask=layout.masks, packed_layout=layout).last_hidden_state[0]  # (14, 32)
    assert packed.shape == (sum(lengths), 32)
    (packed * torch.cat(weights)).sum().backward()
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)
    for name, parameter in decoder.named_parameters():
        assert torch.allclose(parameter.grad, expected[name], atol=1e-5), name


def test_switched_decoder_is_plain_sdpa_without_a_layout():
    """After `use_packed_attention`, a call without a layout (a padded batch, a mask) gives the
    same bits as before; an eager decoder is refused and left as it was."""
    decoder = small_decoder()
    ids, mask = torch.randint(0, 50, (2, 6)), torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    before = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
    assert use_packed_attention(decoder) and use_packed_attention(decoder)  # idempotent
    assert torch.equal(decoder(input_ids=ids, attention_mask=mask).last_hidden_state, before)
    eager = small_decoder("eager")
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_packed_forward_under_autocast(dtype):
    """bf16 autocast (the mixed-precision path): the packed row equals the separate forwards within bf16's rounding."""
    decoder = small_decoder()
    lengths = [4, 6]
    sequences = [torch.randint(0, 50, (length,)) for length in lengths]
    with torch.autocast("cpu", dtype=dtype):
        alone = torch.cat([decoder(input_ids=ids[None]).last_hidden_state[0] for ids in sequences]).float()
        use_packed_attention(decoder)
        layout = PackedLayout.of(torch.tensor(lengths), torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6))
        packed = decoder(input_ids=torch.cat(sequences)[None], position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                         attention_mask=layout.masks, packed_layout=layout).last_hidden_state[0].float()
    assert torch.allclose(packed, alone, atol=5e-2)
