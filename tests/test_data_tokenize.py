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


# --- prompts that fit the model (data/context.py; issue 40, item 2) ------------------------------------

def _examples(*prompts):
    from posttrain.data.examples import Example

    return [Example(id=f"ex{i}", prompt=prompt) if isinstance(prompt, str) else Example(id=f"ex{i}", messages=prompt)
            for i, prompt in enumerate(prompts)]


def _model(positions):
    from types import SimpleNamespace

    return SimpleNamespace(config=SimpleNamespace(**({"max_position_embeddings": positions} if positions else {})))


def test_the_longest_prompt_and_its_parts_by_hand(tokenizer):
    """The tiny tokenizer is one token a character, its template ChatML with one-token markers:
    "123+456=" alone is <|im_start|> + "user\\n" (5) + 8 + <|im_end|> + "\\n" + <|im_start|> +
    "assistant\\n" (10) = 27; the system prompt "Be brief." adds <|im_start|> + "system\\n" (7) + 9 +
    <|im_end|> + "\\n" = 19; the tools' Hermes description (the tiny template ignores tools=) goes
    before it in the same system message with a blank line: its characters + 2."""
    from posttrain.data.context import PromptLength, longest_prompt
    from posttrain.data.tokenize import describe_tools
    from posttrain.rollout.tools import resolve_tools

    examples = _examples("1+1=", "123+456=", "7+8=")
    assert longest_prompt(tokenizer, examples) == PromptLength("ex1", 27, own=27, system=0, tools=0)
    assert longest_prompt(tokenizer, examples, system_prompt="Be brief.") == PromptLength("ex1", 46, own=27, system=19, tools=0)
    tools = resolve_tools(["add"]).schemas()
    described = len(describe_tools(tools)) + 2
    assert longest_prompt(tokenizer, examples, system_prompt="Be brief.", tools=tools) == PromptLength(
        "ex1", 46 + described, own=27, system=19, tools=described)
    assert longest_prompt(tokenizer, []) is None


def test_the_longest_prompt_is_found_among_many_and_in_messages(tokenizer):
    """1,000 short prompts and one long one in the middle, and a conversation whose turns add up."""
    from posttrain.data.context import longest_prompt

    examples = _examples(*["1+1="] * 500, "9" * 300, *["2+2="] * 500)
    assert longest_prompt(tokenizer, examples).example == "ex500" and longest_prompt(tokenizer, examples).tokens == 300 + 19
    conversation = [{"role": "user", "content": "a" * 40}, {"role": "assistant", "content": "b" * 40}, {"role": "user", "content": "c"}]
    found = longest_prompt(tokenizer, _examples("d" * 60, conversation))
    assert (found.example, found.tokens) == ("ex1", len(ids(tokenizer, render_prompt(tokenizer, conversation))))


def test_a_prompt_and_its_answer_past_the_models_positions_is_one_line(tokenizer):
    """46 + 15 = 61 positions for a model of 60: refused, naming the prompt, the limit and the parts,
    largest first; 46 + 14 = 60 fits; a model whose config names no limit is unlimited."""
    from posttrain.data.context import PromptSet, check_prompts_fit

    examples = _examples("1+1=", "123+456=")
    fits = [PromptSet("training", examples, 14, "sampling.max_new_tokens")]
    check_prompts_fit(_model(60), tokenizer, fits, system_prompt="Be brief.")
    check_prompts_fit(_model(None), tokenizer, [PromptSet("training", examples, 10**6, "sampling.max_new_tokens")])
    too_long = [*fits, PromptSet("held-out", examples, 15, "acceptance.max_new_tokens")]
    with pytest.raises(UserError) as refused:
        check_prompts_fit(_model(60), tokenizer, too_long, system_prompt="Be brief.")
    assert str(refused.value) == (
        "the longest held-out prompt (example ex1) is 46 tokens, and with acceptance.max_new_tokens 15 it needs 61 positions, "
        "more than the model's 60 (max_position_embeddings); they go to the prompt itself 27, data.system_prompt 19, "
        "the answer 15: shorten these prompts or leave the longest out, or lower acceptance.max_new_tokens to 14 at most")


def test_a_long_description_of_tools_is_named_as_the_cause(tokenizer):
    """The README's example on the tiny model: `add` and `calculator` described to a 6-token
    prompt take 1,034 of its 1,059 tokens, past the 1,024 positions before any answer."""
    from posttrain.data.context import PromptSet, check_prompts_fit, context_limit
    from posttrain.models.tiny import build_tiny_model
    from posttrain.rollout.tools import resolve_tools

    model, _ = build_tiny_model()
    assert context_limit(model) == 1024
    with pytest.raises(UserError) as refused:
        check_prompts_fit(model, tokenizer, [PromptSet("training", _examples("59+46="), 48, "sampling.max_new_tokens")],
                          tools=resolve_tools(["add", "calculator"]).schemas())
    assert str(refused.value) == (
        "the longest training prompt (example ex0) is 1,059 tokens, and with sampling.max_new_tokens 48 it needs 1,107 "
        "positions, more than the model's 1,024 (max_position_embeddings); they go to the tools' descriptions (add, "
        "calculator) 1,034, the answer 48, the prompt itself 25: name fewer tools, or tools.describe none for a model "
        "that learned its tools from transcripts (posttrain demo --tools)")
