"""Canonical masks on hand-built examples: prompt, padding on either side, EOS, truncation."""

import pytest
import torch

from posttrain.data import (
    TruncationPolicy,
    collate_token_ids,
    position_ids_from_attention_mask,
    render_prompt,
    tokenize_prompt_response,
    tokenize_prompts,
)
from posttrain.errors import UserError
from posttrain.models import build_tiny_tokenizer

EOS = 2  # tiny tokenizer: <pad>=0 <unk>=1 <|im_end|>=2 <|im_start|>=3, then one id per character


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_right_padding_masks_by_hand(tokenizer):
    """Plain prompts "1+2=" (4 tokens) and "10+20=" (6 tokens), responses "3" and "30".
    Row 0: 4 prompt + "3" + EOS = 6 tokens, padded to 9 on the right; row 1: 6 + 2 + 1 = 9."""
    batch = tokenize_prompt_response(
        tokenizer, ["1+2=", "10+20="], ["3", "30"], use_chat_template=False
    )
    assert batch.input_ids.tolist() == [
        ids(tokenizer, "1+2=3") + [EOS, 0, 0, 0],
        ids(tokenizer, "10+20=30") + [EOS],
    ]
    assert batch.attention_mask.tolist() == [[1] * 6 + [0] * 3, [1] * 9]
    assert batch.mask.dtype == torch.bool
    assert batch.mask.tolist() == [
        [False] * 4 + [True, True] + [False] * 3,
        [False] * 6 + [True, True, True],
    ]
    assert batch.prompt_lengths.tolist() == [4, 6]
    assert batch.response_lengths.tolist() == [2, 3]


def test_left_padding_masks_by_hand(tokenizer):
    """Same pairs, padded on the left: row 0 gets 3 pad tokens in front."""
    batch = tokenize_prompt_response(
        tokenizer, ["1+2=", "10+20="], ["3", "30"], use_chat_template=False, padding_side="left"
    )
    assert batch.input_ids[0].tolist() == [0, 0, 0] + ids(tokenizer, "1+2=3") + [EOS]
    assert batch.attention_mask[0].tolist() == [0] * 3 + [1] * 6
    assert batch.mask[0].tolist() == [False] * 7 + [True, True]
    assert position_ids_from_attention_mask(batch.attention_mask)[0].tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5]


def test_chat_template_prompt_and_eos_not_doubled(tokenizer):
    """The chat template wraps the prompt; a response already ending in EOS gets no second one."""
    text = render_prompt(tokenizer, "1+2=")
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    batch = tokenize_prompt_response(tokenizer, ["1+2="], ["3<|im_end|>"])
    row = batch.input_ids[0].tolist()
    assert tokenizer.decode(row) == text + "3<|im_end|>"
    assert row.count(EOS) == 2  # one closing the user turn, one ending the response
    assert batch.mask[0].tolist() == [False] * (len(row) - 2) + [True, True]


def test_system_prompt_and_plain_fallback(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, messages, system_prompt="Be brief.").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>"
    )
    assert render_prompt(tokenizer, "hi", system_prompt="Be brief.", use_chat_template=False) == "Be brief.\n\nhi"
    assert render_prompt(tokenizer, messages, use_chat_template=False) == "User: hi\nAssistant:"


def test_truncation_is_counted(tokenizer):
    """Prompt "123456" with max 4 keeps "3456" (policy left); response "abcdef"+EOS (7 tokens) with max 3
    keeps "abc" and loses its EOS; the counts say so."""
    policy = TruncationPolicy(max_prompt_tokens=4, max_response_tokens=3, prompt="left", response="right")
    batch = tokenize_prompt_response(
        tokenizer, ["123456", "12"], ["abcdef", "x"], truncation=policy, use_chat_template=False
    )
    assert batch.input_ids[0].tolist() == ids(tokenizer, "3456abc")
    assert batch.mask[0].tolist() == [False] * 4 + [True] * 3
    assert batch.input_ids[1].tolist() == ids(tokenizer, "12x") + [EOS, 0, 0, 0]
    assert (batch.counts.prompts_truncated, batch.counts.responses_truncated, batch.counts.dropped) == (1, 1, 0)
    assert batch.kept == [0, 1]


def test_truncation_drop_and_error(tokenizer):
    drop = TruncationPolicy(max_prompt_tokens=4, max_response_tokens=3, prompt="drop", response="drop")
    batch = tokenize_prompt_response(
        tokenizer, ["123456", "12", "1"], ["a", "x", "abcd"], truncation=drop, use_chat_template=False
    )
    assert batch.kept == [1]
    assert batch.counts.dropped == 2
    assert batch.input_ids.tolist() == [ids(tokenizer, "12x") + [EOS]]
    with pytest.raises(UserError, match="example 0: prompt has 6 tokens, more than max_prompt_tokens=4"):
        tokenize_prompt_response(
            tokenizer, ["123456"], ["a"], truncation=TruncationPolicy(max_prompt_tokens=4),
            use_chat_template=False,
        )
    with pytest.raises(UserError, match="all 1 examples were dropped"):
        tokenize_prompt_response(tokenizer, ["123456"], ["a"], truncation=drop, use_chat_template=False)


def test_prompts_only_and_collate_from_ids():
    """tokenize_prompts left-pads with an all-False mask; collate works from sampler ids, and the
    mask comes from lengths even when pad id == EOS id (as in SmolLM2)."""
    tokenizer = build_tiny_tokenizer()
    batch = tokenize_prompts(tokenizer, ["1+2=", "1="], use_chat_template=False)
    assert batch.input_ids.tolist() == [ids(tokenizer, "1+2="), [0, 0] + ids(tokenizer, "1=")]
    assert not batch.mask.any()
    collated = collate_token_ids([[5, 6], [7]], [[9, 2], [2]], pad_token_id=2)
    assert collated.input_ids.tolist() == [[5, 6, 9, 2], [7, 2, 2, 2]]
    assert collated.mask.tolist() == [[False, False, True, True], [False, True, False, False]]


def test_batch_records_move_to_a_device_at_one_boundary():
    """`to(device)` moves every tensor of a TokenizedBatch / PreferenceBatch (here to the meta
    device: shapes and dtypes kept), and nothing else."""
    from posttrain.data import tokenize_preference_pairs
    from posttrain.data.preference import PreferencePair
    from posttrain.models import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    pairs = [PreferencePair(id="a", prompt="1+1=", chosen="2", rejected="3"), PreferencePair(id="b", prompt="2+2=", chosen="4", rejected="44")]
    batch = tokenize_preference_pairs(tokenizer, pairs)
    moved = batch.to("meta")
    for side in ("chosen", "rejected"):
        before, after = getattr(batch, side), getattr(moved, side)
        for name in ("input_ids", "attention_mask", "mask", "prompt_lengths", "response_lengths"):
            assert getattr(after, name).device.type == "meta"
            assert getattr(after, name).shape == getattr(before, name).shape and getattr(after, name).dtype == getattr(before, name).dtype
        assert after.kept == before.kept and getattr(before, "input_ids").device.type == "cpu"
    assert moved.kept == batch.kept
