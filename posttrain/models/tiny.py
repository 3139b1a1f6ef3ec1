"""The `tiny` model: a small Llama built in code, with a character-level tokenizer.

Every printable ASCII character, newline and tab is one token, so the tiny model can write anything
the procedural tasks ask for (digits, letters, operators, Python code) without a trained tokenizer.
The chat template is ChatML, and its end-of-turn token `<|im_end|>` is also the EOS, so a sampled
answer stops where the template says a turn ends. Weights are random (seeded); the SFT recipe
trains them.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
EOS_TOKEN = "<|im_end|>"
CHAT_START_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, EOS_TOKEN, CHAT_START_TOKEN]
# string.printable minus the rare vertical whitespace (\x0b \x0c \r): 97 characters.
CHARACTERS = [c for c in string.printable if c not in "\x0b\x0c\r"]

# ChatML; `add_generation_prompt` opens the assistant turn, whose text the model then writes. An
# assistant message's `tool_calls` (the transformers / TRL chat format: {"type": "function",
# "function": {"name", "arguments"}}) are written after its content in the Hermes form,
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and a `tool` message is a turn of
# role `tool`: the ChatML-style fallback the tiny model's tool episodes and SFT transcripts use
# (its generation stops at `<|im_end|>`, so a turn of tool calls ends as any other turn).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}"
    "{{ '}</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Sized so a CPU forward+backward on 16 x 64 tokens takes well under a second (about 3.2M params).
TINY_CONFIG = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: ids 0-3 are `<pad> <unk> <|im_end|> <|im_start|>`, then one id
    per character (101 tokens). Decoding joins characters with nothing between them."""
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One pre-token per character, including whitespace and newlines.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[CHAT_START_TOKEN],
        model_max_length=TINY_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.name_or_path = "tiny"
    return tokenizer


def build_tiny_model(seed: int = 0, **overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised small LlamaForCausalLM and its tokenizer, float32 on CPU.

    The same seed gives the same weights every time (the global RNG is left untouched).
    `overrides` replace entries of `TINY_CONFIG` (e.g. `num_hidden_layers=2`).
    """
    tokenizer = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **{**TINY_CONFIG, **overrides},
    )
    # An adapter saved on top records this as its base; only the default build is the spec "tiny".
    config.name_or_path = "tiny" if seed == 0 and not overrides else f"tiny (seed {seed}, {overrides})"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model, tokenizer
