"""Prompt rendering and the canonical tokenisation of prompt + response pairs.

Mask convention (docs/rollout.md, "`Rollout` fields"): `mask[i, t]` is True when token `input_ids[i, t]` belongs to
the response, including the EOS that ends it; prompt and padding are False. The log-prob of token t
comes from the logits at t-1, so a loss over response tokens uses `logits[:, :-1]`, labels
`input_ids[:, 1:]` and `mask[:, 1:]`.

Prompt and response are tokenised separately and concatenated, so the prompt tokens are exactly the
ones a sampler conditions on (joint tokenisation can merge characters across the boundary).
Over-long prompts and responses follow a `TruncationPolicy`, and every truncation or drop is counted
in the returned `TruncationCounts`, so a recipe can put the policy and the counts in its run card.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Sequence

import torch

from posttrain.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Prompt = str | list[dict]  # a plain string, or chat messages [{"role": ..., "content": ...}]


@dataclass
class TruncationPolicy:
    """What to do with prompts and responses longer than their limits (None = no limit)."""

    max_prompt_tokens: int | None = None
    """Longest prompt, in tokens after the chat template."""
    max_response_tokens: int | None = None
    """Longest response, in tokens including the EOS."""
    prompt: Literal["error", "left", "drop"] = "error"
    """error: stop (validation should have caught it); left: keep the prompt's last tokens; drop: skip."""
    response: Literal["right", "drop", "error"] = "right"
    """right: keep the first tokens (the cut response then has no EOS); drop: skip the pair; error: stop."""


@dataclass
class TruncationCounts:
    """How many examples the policy changed: record these next to the policy."""

    prompts_truncated: int = 0
    responses_truncated: int = 0
    dropped: int = 0


@dataclass
class TokenizedBatch:
    """A padded batch of prompt + response token ids (N rows, L = longest row)."""

    input_ids: torch.Tensor
    """(N, L) long; padding uses the tokenizer's pad id."""
    attention_mask: torch.Tensor
    """(N, L) long, 1 = real token (prompt or response), 0 = padding (Hugging Face convention)."""
    mask: torch.Tensor
    """(N, L) bool, True = response token including the ending EOS; prompt and padding False."""
    prompt_lengths: torch.Tensor
    """(N,) long, prompt tokens per row."""
    response_lengths: torch.Tensor
    """(N,) long, response tokens per row (including the EOS when present)."""
    kept: list[int] = field(default_factory=list)
    """Index into the inputs of each row (all inputs unless the policy dropped some)."""
    counts: TruncationCounts = field(default_factory=TruncationCounts)

    def to(self, device: torch.device | str) -> TokenizedBatch:
        """The same batch with every tensor on `device` (the one place a batch moves to a device)."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when the tokenizer carries its own chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The text a model sees before its response.

    With a chat template (the default when the tokenizer has one) a string prompt becomes one user
    message, `system_prompt` (if any, and if the messages do not start with one) is prepended, and
    the template opens the assistant turn. Without a template a string prompt is used as is
    (after `system_prompt` and a blank line), and messages become `Role: content` lines ending
    with `Assistant:`.

    `tools` (JSON schemas in the OpenAI function form, a tool episode's): passed to the template's
    `tools=`; a template that ignores them (its rendering is the same without) gets them as a
    system message instead (`describe_tools`, the Hermes form), so the model is always told.
    """
    if use_chat_template is None:
        use_chat_template = has_chat_template(tokenizer)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and (not messages or messages[0].get("role") != "system"):
        messages = [{"role": "system", "content": system_prompt}] + messages
    if use_chat_template:
        messages, extra = with_tools(tokenizer, messages, tools)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    if tools:
        messages = _with_tool_description(messages, tools)
        system_prompt = messages[0]["content"]
    if isinstance(prompt, str):
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


def describe_tools(tools: list[dict]) -> str:
    """The tools' schemas as a system text in the Hermes form (Qwen2.5's and NousResearch's
    convention): one JSON schema per line inside <tools></tools>, and how a call is written."""
    import json

    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call tools. Their signatures are inside <tools></tools>:\n<tools>\n" + schemas + "\n</tools>\n"
            'To call one, write <tool_call>{"name": <tool name>, "arguments": <arguments as a JSON object>}</tool_call>; '
            "its result comes back in the next message.")


def with_tools(tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None) -> tuple[list[dict], dict]:
    """How a conversation is told about `tools` (JSON schemas), the same way for prompts
    (`render_prompt`) and SFT transcripts (`sft_data.chat_token_mask`): `(messages, {"tools": tools})`
    when the chat template renders them, else `(messages with describe_tools(tools) as the system
    message, {})`; no tools: `(messages, {})`."""
    if not tools:
        return messages, {}
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    if tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) != plain:
        return messages, {"tools": tools}
    return _with_tool_description(messages, tools), {}


def _with_tool_description(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` whose system message (added when absent) starts with `describe_tools(tools)`."""
    description = describe_tools(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": description + "\n\n" + messages[0]["content"]}] + messages[1:]
    return [{"role": "system", "content": description}] + messages


def tokenize_prompt_response(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    responses: Sequence[str],
    *,
    truncation: TruncationPolicy | None = None,
    padding_side: Literal["right", "left"] = "right",
    add_eos: bool = True,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
) -> TokenizedBatch:
    """Tokenise N (prompt, response) pairs into one padded batch with the canonical masks.

    Each row is `render_prompt(prompt)` tokens, then the response tokens, then the EOS (unless the
    response already ends with it, or `add_eos` is False), padded on `padding_side`.
    Returns a `TokenizedBatch` of shape (N', L) where N' = N minus the pairs the policy dropped.
    Raises UserError when the policy says "error" and a row is too long, or when nothing is left.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    truncation = truncation or TruncationPolicy()
    prompt_ids = [
        encode_prompt(tokenizer, p, system_prompt=system_prompt, use_chat_template=use_chat_template)
        for p in prompts
    ]
    response_ids = [encode_response(tokenizer, response, add_eos=add_eos) for response in responses]
    prompt_ids, response_ids, kept, counts = apply_truncation(prompt_ids, response_ids, truncation)
    if not kept:
        raise UserError(f"all {len(prompts)} examples were dropped by the truncation policy {truncation}")
    batch = collate_token_ids(
        prompt_ids, response_ids, pad_token_id=tokenizer.pad_token_id, padding_side=padding_side
    )
    batch.kept, batch.counts = kept, counts
    return batch


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    *,
    truncation: TruncationPolicy | None = None,
    padding_side: Literal["right", "left"] = "left",
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
) -> TokenizedBatch:
    """Prompts alone, left-padded by default (ready for generation); `mask` is all False."""
    return tokenize_prompt_response(
        tokenizer, prompts, [""] * len(prompts), truncation=truncation, padding_side=padding_side,
        add_eos=False, system_prompt=system_prompt, use_chat_template=use_chat_template,
    )


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool | None = None,
) -> list[int]:
    """Token ids of `render_prompt(...)`. A chat template writes its own special tokens (BOS
    included), so only a plain prompt gets the tokenizer's automatic ones."""
    if use_chat_template is None:
        use_chat_template = has_chat_template(tokenizer)
    text = render_prompt(tokenizer, prompt, system_prompt=system_prompt, use_chat_template=use_chat_template)
    return tokenizer(text, add_special_tokens=not use_chat_template)["input_ids"]


def encode_response(tokenizer: PreTrainedTokenizerBase, response: str, *, add_eos: bool = True) -> list[int]:
    """Token ids of a response (no automatic special tokens), ending with the EOS when `add_eos`
    (not doubled when the text already ends with it)."""
    ids = tokenizer(response, add_special_tokens=False)["input_ids"] if response else []
    if add_eos and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids = ids + [tokenizer.eos_token_id]
    return ids


def apply_truncation(
    prompt_ids: list[list[int]], response_ids: list[list[int]], policy: TruncationPolicy
) -> tuple[list[list[int]], list[list[int]], list[int], TruncationCounts]:
    """Apply `policy` to token id lists; returns the kept prompts, responses, their input indices and
    the counts. Logs one line when anything was truncated or dropped."""
    counts = TruncationCounts()
    kept_prompts, kept_responses, kept = [], [], []
    for index, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        limit = policy.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            if policy.prompt == "error":
                raise UserError(
                    f"example {index}: prompt has {len(prompt)} tokens, more than max_prompt_tokens={limit}"
                    " (truncation policy prompt='error'; use 'left' or 'drop')"
                )
            if policy.prompt == "drop":
                counts.dropped += 1
                continue
            prompt = prompt[len(prompt) - limit:]
            counts.prompts_truncated += 1
        limit = policy.max_response_tokens
        if limit is not None and len(response) > limit:
            if policy.response == "error":
                raise UserError(
                    f"example {index}: response has {len(response)} tokens, more than "
                    f"max_response_tokens={limit} (truncation policy response='error'; use 'right' or 'drop')"
                )
            if policy.response == "drop":
                counts.dropped += 1
                continue
            response = response[:limit]
            counts.responses_truncated += 1
        kept_prompts.append(prompt)
        kept_responses.append(response)
        kept.append(index)
    if counts.prompts_truncated or counts.responses_truncated or counts.dropped:
        logger.info(
            "truncation policy %s: %d prompts truncated, %d responses truncated, %d dropped (of %d)",
            policy, counts.prompts_truncated, counts.responses_truncated, counts.dropped, len(prompt_ids),
        )
    return kept_prompts, kept_responses, kept, counts


def collate_token_ids(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    padding_side: Literal["right", "left"] = "right",
) -> TokenizedBatch:
    """Concatenate each prompt with its response and pad into a `TokenizedBatch` (N, L).

    Masks come from lengths, never from token values (SmolLM2's pad id equals its EOS id).
    """
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    rows = len(prompt_ids)
    length = max((len(p) + len(r) for p, r in zip(prompt_ids, response_ids)), default=0)
    input_ids = torch.full((rows, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.bool)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        total = len(prompt) + len(response)
        start = 0 if padding_side == "right" else length - total
        input_ids[row, start:start + total] = torch.tensor(list(prompt) + list(response), dtype=torch.long)
        attention_mask[row, start:start + total] = 1
        mask[row, start + len(prompt):start + total] = True
    return TokenizedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        prompt_lengths=torch.tensor([len(p) for p in prompt_ids], dtype=torch.long),
        response_lengths=torch.tensor([len(r) for r in response_ids], dtype=torch.long),
        kept=list(range(rows)),
    )


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, L) long positions counting only real tokens (0 at each row's first real token), so a
    left-padded row gets the same positions as the unpadded one; padding gets 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
