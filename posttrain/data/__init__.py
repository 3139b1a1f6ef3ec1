"""Data: prompt tasks, preference pairs, chat templates, the canonical masks, and validation.

Public API (signatures are the contract other modules rely on):

    tokenize_prompt_response(tokenizer, prompts: Sequence[str | list[dict]], responses: Sequence[str], *,
        truncation: TruncationPolicy | None = None, padding_side: "right" | "left" = "right",
        add_eos: bool = True, system_prompt: str | None = None, use_chat_template: bool | None = None)
        -> TokenizedBatch
        TokenizedBatch fields: input_ids (N, L) long; attention_mask (N, L) long 1/0;
        mask (N, L) bool, True = response token incl. the ending EOS, prompt/padding False;
        prompt_lengths (N,) long; response_lengths (N,) long; kept: list[int] (input index of each
        row); counts: TruncationCounts(prompts_truncated, responses_truncated, dropped).
        The log-prob of token t comes from logits[:, t-1]: use mask[:, 1:] with labels input_ids[:, 1:].
    tokenize_prompts(tokenizer, prompts, *, truncation=None, padding_side="left", system_prompt=None,
        use_chat_template=None) -> TokenizedBatch            # prompts only, mask all False
    collate_token_ids(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], *,
        pad_token_id: int, padding_side="right") -> TokenizedBatch   # for ids a sampler produced
    render_prompt(tokenizer, prompt, *, system_prompt=None, use_chat_template=None) -> str
    encode_prompt(tokenizer, prompt, *, system_prompt=None, use_chat_template=None) -> list[int]
    TruncationPolicy(max_prompt_tokens=None, max_response_tokens=None,
        prompt: "error" | "left" | "drop" = "error", response: "right" | "drop" | "error" = "right")
    position_ids_from_attention_mask(attention_mask (N, L)) -> (N, L) long
"""

from posttrain.data.tokenize import (
    Prompt,
    TokenizedBatch,
    TruncationCounts,
    TruncationPolicy,
    apply_truncation,
    collate_token_ids,
    encode_prompt,
    has_chat_template,
    position_ids_from_attention_mask,
    render_prompt,
    tokenize_prompt_response,
    tokenize_prompts,
)

__all__ = [
    "Prompt",
    "TokenizedBatch",
    "TruncationCounts",
    "TruncationPolicy",
    "apply_truncation",
    "collate_token_ids",
    "encode_prompt",
    "has_chat_template",
    "position_ids_from_attention_mask",
    "render_prompt",
    "tokenize_prompt_response",
    "tokenize_prompts",
]
