"""Prompts that fit the model: its context limit, and the check every command that samples runs
before any work.

A prompt and the tokens generated after it share the model's positions (`max_position_embeddings`
of its config). Past them the model reads positions it was never trained on and writes garbage,
with only a transformers warning to say so. `check_prompts_fit` refuses that at set-up, in one line
naming the longest prompt, the limit and what made the prompt long: its own text, the system
prompt, or the tools' descriptions (the Hermes description of `add` and `calculator` alone is
1,030 of the tiny model's 1,024 positions). A model whose config has no such limit is unlimited.

The longest prompts are found without rendering every one (a training set of 20,000 prompts that
each carry the tools' description would take a minute to render and tokenise): the examples' own
texts are tokenised, and the `CANDIDATES` with the most own tokens are rendered as the sampler
renders them (chat template, system prompt, tools) and counted exactly. Every prompt of a set
shares its template, system prompt and tools, so the longest own text makes the longest prompt, up
to a few tokens of a chat turn's header; the candidates' margin covers those.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.data.examples import Example
from posttrain.data.tokenize import render_prompt
from posttrain.errors import UserError

CANDIDATES = 32
"""How many prompts of a set (those with the most tokens of their own) are rendered and counted exactly."""
CHUNK = 1000
"""Own texts tokenised per call (the tokenizer's batch call slows down on very long lists)."""


@dataclass(frozen=True)
class PromptSet:
    """A set of prompts a command samples from, and the generation budget each answer gets."""

    name: str
    """What the one line calls it: "training", "held-out", "held-out 'digits_3'"."""
    examples: Sequence[Example]
    max_new_tokens: int
    """Tokens generated after each prompt (a tool episode's first turn: the first turn's budget)."""
    budget: str
    """The setting that gives `max_new_tokens` (sampling.max_new_tokens, acceptance.max_new_tokens)."""


@dataclass(frozen=True)
class PromptLength:
    """The longest prompt of a set, in the tokens the sampler conditions on, and what it is made of."""

    example: str
    """Its example's id."""
    tokens: int
    """Its tokens as rendered for the sampler (chat template, system prompt, tools' descriptions)."""
    own: int
    """Its tokens rendered alone (its chat template, without the system prompt and the tools)."""
    system: int
    """What the system prompt adds."""
    tools: int
    """What the tools' descriptions add."""


def context_limit(model) -> int | None:
    """The positions a prompt and its completion share: `max_position_embeddings` of the model's
    config (a LoRA-wrapped model's base); None: the config names no limit."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def _own_text(example: Example) -> str:
    prompt = example.prompt_input
    return prompt if isinstance(prompt, str) else "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in prompt)


def _count(tokenizer, text: str) -> int:
    # As the sampler tokenises it (rollout/engine.py); verbose=False: transformers' own too-long warning is this check's job.
    return len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def longest_prompt(tokenizer, examples: Sequence[Example], *, system_prompt: str | None = None,
                   tools: list[dict] | None = None) -> PromptLength | None:
    """The longest of `examples`' prompts as `render_prompt(..., system_prompt, tools)` gives them to
    the sampler, among the `CANDIDATES` with the most tokens of their own text; None: no examples."""
    if not examples:
        return None
    texts = [_own_text(example) for example in examples]
    own = [len(ids) for start in range(0, len(texts), CHUNK)
           for ids in tokenizer(texts[start:start + CHUNK], add_special_tokens=False, return_attention_mask=False,
                                verbose=False)["input_ids"]]
    candidates = sorted(range(len(examples)), key=lambda i: -own[i])[:CANDIDATES]
    lengths = {i: _count(tokenizer, render_prompt(tokenizer, examples[i].prompt_input, system_prompt=system_prompt, tools=tools))
               for i in candidates}
    longest = max(candidates, key=lambda i: lengths[i])
    prompt = examples[longest].prompt_input
    alone = _count(tokenizer, render_prompt(tokenizer, prompt))
    with_system = _count(tokenizer, render_prompt(tokenizer, prompt, system_prompt=system_prompt)) if system_prompt else alone
    return PromptLength(example=examples[longest].id, tokens=lengths[longest], own=alone, system=with_system - alone,
                        tools=lengths[longest] - with_system)


def check_prompts_fit(model, tokenizer, sets: Sequence[PromptSet], *, system_prompt: str | None = None,
                      tools: list[dict] | None = None, system_setting: str = "data.system_prompt") -> None:
    """One UserError line when a prompt of any of `sets` plus its set's `max_new_tokens` is longer than
    the model's positions (`context_limit`): the longest prompt, its set and example, the limit, and
    what made it long (its own text, `system_setting`, the tools' descriptions: `tools` are the JSON
    schemas the prompts are rendered with) with what to change. Nothing when the model has no limit."""
    limit = context_limit(model)
    if limit is None:
        return
    for prompt_set in sets:
        longest = longest_prompt(tokenizer, prompt_set.examples, system_prompt=system_prompt, tools=tools)
        if longest is not None and longest.tokens + prompt_set.max_new_tokens > limit:
            raise UserError(_too_long(prompt_set, longest, limit, tools, system_setting))


def _too_long(prompt_set: PromptSet, longest: PromptLength, limit: int, tools: list[dict] | None, system_setting: str) -> str:
    """The one line: the prompt, the limit, what the positions go to (largest first), and what to change."""
    described = f"the tools' descriptions ({', '.join(tool.get('function', tool).get('name', '?') for tool in tools or [])})"
    prompt_parts = {described: longest.tools, system_setting: longest.system, "the prompt itself": longest.own}
    remedies = {
        described: "name fewer tools, or tools.describe none for a model that learned its tools from transcripts (posttrain demo --tools)",
        system_setting: f"shorten {system_setting}",
        "the prompt itself": "shorten these prompts or leave the longest out",
    }
    cause = max(prompt_parts, key=prompt_parts.get)
    options = [remedies[cause]]
    room = limit - longest.tokens
    if room > 0:  # the prompt fits alone: a smaller budget fits it, the one way when the answer takes the most
        lower = f"lower {prompt_set.budget} to {room} at most"
        options = [lower] if prompt_set.max_new_tokens > prompt_parts[cause] else [*options, lower]
    parts = sorted({**prompt_parts, "the answer": prompt_set.max_new_tokens}.items(), key=lambda part: -part[1])
    needed = longest.tokens + prompt_set.max_new_tokens
    return (f"the longest {prompt_set.name} prompt (example {longest.example}) is {longest.tokens:,} tokens, and with "
            f"{prompt_set.budget} {prompt_set.max_new_tokens} it needs {needed:,} positions, more than the model's "
            f"{limit:,} (max_position_embeddings); they go to {', '.join(f'{name} {n:,}' for name, n in parts if n)}: "
            f"{', or '.join(options)}")


def heldout_budget(acceptance_tokens: int | None, sampling_tokens: int) -> tuple[int, str]:
    """A held-out answer's budget and the setting that gives it: acceptance.max_new_tokens, or
    sampling.max_new_tokens when that is None (the online recipe's default)."""
    if acceptance_tokens is None:
        return sampling_tokens, "sampling.max_new_tokens"
    return acceptance_tokens, "acceptance.max_new_tokens"


__all__ = ["CANDIDATES", "PromptLength", "PromptSet", "check_prompts_fit", "context_limit", "heldout_budget", "longest_prompt"]
