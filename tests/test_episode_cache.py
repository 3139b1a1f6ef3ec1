"""A continued KV cache (`engine.Session`) against re-prefilling every turn: the same episodes, token for token.

Why the log-probs are compared at 1e-5 and not exactly: a resumed turn's attention reads keys and
values written in pieces (turn 1's prefill, its decode steps, the observation's prefill) where the
re-prefill computes them in one prefill, with other matmul shapes and reduction orders, so the
float32 logits may differ in their last bits (measured here: ~1e-7). A token would flip only if a
row's uniform number fell within that distance of a boundary of the sampling CDF; on the tiny
model with these seeds none does, and the tokens are compared exactly: the test is deterministic,
so a flip would fail it every time, not by chance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from posttrain.models.tiny import build_tiny_model
from posttrain.rollout import SamplingConfig, generate
from posttrain.rollout import episodes as episodes_module
from posttrain.rollout.engine import Session
from posttrain.rollout.episodes import EpisodeSampler, ToolSettings
from posttrain.rollout.tool_calls import ToolCall

LOGPROB_TOLERANCE = 1e-5
# Frequent tokens of the random tiny model made stop tokens: its rows end turns at different lengths
# (the ragged case: holes between a row's turn and its observation in the resumed cache).
STOPS = (80, 66, 21, 73, 46, 16, 39, 29)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model()


@dataclass
class Result:
    content: str
    status: str = "ok"
    reason: str = ""


class LengthyToolbox:
    """Answers a call with a result whose length depends on its arguments (ragged observations)."""

    def schemas(self):
        return [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}]

    def execute(self, calls):
        return [Result("7" * (1 + 3 * call.arguments["a"])) for call in calls]


def every_turn_calls(text: str) -> list[ToolCall]:
    """The random model writes no tool call: every turn's text is read as one (its ids untouched)."""
    return [ToolCall("add", {"a": len(text) % 5, "b": 1})]


class CountingSession(Session):
    """A `Session` that remembers itself, to show the cached path ran."""

    made: list[Session] = []

    def __init__(self):
        super().__init__()
        CountingSession.made.append(self)


def _episodes(tiny, continue_cache, settings, sampling, prompts, seed, shard=None):
    model, tokenizer = tiny
    sampler = EpisodeSampler(tokenizer, LengthyToolbox(), settings, continue_cache=continue_cache)
    return sampler(model, tokenizer, [None] * len(prompts), prompts, group_size=2, sampling=sampling, seed=seed, shard=shard)


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"{i}+{3 * i}="}], add_generation_prompt=True,
                                          tokenize=False) for i in range(4)]


@pytest.mark.parametrize("settings", [ToolSettings(names=["add"], max_turns=3),
                                      ToolSettings(names=["add"], max_turns=4, max_episode_tokens=70)],
                         ids=["three_turns", "episode_budget"])
def test_a_continued_cache_samples_the_episodes_of_re_prefilling(tiny, monkeypatch, settings):
    model, tokenizer = tiny
    monkeypatch.setattr(episodes_module, "parse_tool_calls", every_turn_calls)
    monkeypatch.setattr(episodes_module, "Session", CountingSession)
    CountingSession.made.clear()
    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=STOPS)
    cached = _episodes(tiny, True, settings, sampling, prompts, seed=5)
    assert len(CountingSession.made) == 1 and CountingSession.made[0].resumed > 0
    plain = _episodes(tiny, False, settings, sampling, prompts, seed=5)
    assert len(CountingSession.made) == 1  # continue_cache=False: every turn re-prefilled by `generate`
    turns = [e["turns"] for e in plain.episodes]
    assert max(turns) >= 3 and min(turns) < max(turns)  # rows went on, and ended, at different turns
    assert torch.equal(cached.completion_ids, plain.completion_ids)
    assert torch.equal(cached.mask, plain.mask) and torch.equal(cached.attention, plain.attention)
    assert torch.equal(cached.prompt_ids, plain.prompt_ids) and torch.equal(cached.finished, plain.finished)
    assert cached.texts == plain.texts and cached.episodes == plain.episodes
    torch.testing.assert_close(cached.logprobs, plain.logprobs, rtol=0, atol=LOGPROB_TOLERANCE)
    torch.testing.assert_close(cached.sampler_logprobs, plain.sampler_logprobs, rtol=0, atol=LOGPROB_TOLERANCE)


def test_a_shard_resumes_its_rows_of_the_whole_batch(tiny, monkeypatch):
    """torchrun's ranks: rows are kept and found by their place in the whole batch (`shard`, `draws`)."""
    monkeypatch.setattr(episodes_module, "parse_tool_calls", every_turn_calls)
    prompts, settings = _prompts(tiny[1]), ToolSettings(names=["add"], max_turns=3)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=STOPS)
    whole = _episodes(tiny, True, settings, sampling, prompts, seed=5)
    part = _episodes(tiny, True, settings, sampling, prompts[2:], seed=5, shard=(2, 4))
    assert part.texts == whole.texts[4:] and part.episodes == whole.episodes[4:]
    width = part.completion_ids.shape[1]
    assert torch.equal(part.completion_ids, whole.completion_ids[4:, :width]) and not whole.mask[4:, width:].any()


def test_a_session_resumes_rows_in_any_order_and_chunk_beside_fresh_prompts(tiny):
    """Turn 2 of some rows (shuffled, in chunks of 2, ragged new tokens) and a prompt the session never
    saw, against `generate` on the same contexts and draws."""
    model, tokenizer = tiny
    prompts = [tokenizer(f"q{i} " * (1 + i), add_special_tokens=False)["input_ids"] for i in range(3)]
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, stop_token_ids=STOPS)
    session = Session()
    first = session.generate(model, tokenizer, prompts, group_size=2, sampling=sampling, seed=3, max_batch_size=2)
    assert torch.equal(first.completion_ids, generate(model, tokenizer, prompts, group_size=2, sampling=sampling, seed=3).completion_ids)
    rows = [4, 1, 5, 0, 2]
    contexts = [prompts[r // 2] + first.completion_ids[r, first.mask[r]].tolist() + [7] * (1 + r) for r in rows]
    contexts[3] = prompts[0] + [9, 9]  # place 0 was kept, but with other ids: prefilled in a chunk with a resumed row
    places = (rows, 6)
    second = session.generate(model, tokenizer, contexts, sampling=sampling, seed=4, draws=places, max_batch_size=2)
    expected = generate(model, tokenizer, contexts, sampling=sampling, seed=4, draws=places)
    assert session.resumed == len(rows) - 1
    assert torch.equal(second.completion_ids, expected.completion_ids) and torch.equal(second.mask, expected.mask)
    assert second.texts == expected.texts and torch.equal(second.prompt_ids, expected.prompt_ids)
    torch.testing.assert_close(second.logprobs, expected.logprobs, rtol=0, atol=LOGPROB_TOLERANCE)


def test_the_generic_decoder_re_prefills(tiny):
    """backend hf cannot resume: a session there is `generate`, exactly."""
    model, tokenizer = tiny
    prompt = tokenizer("a b c", add_special_tokens=False)["input_ids"]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
    session = Session()
    first = session.generate(model, tokenizer, [prompt], sampling=sampling, seed=1, backend="hf")
    context = prompt + first.completion_ids[0].tolist() + [5, 6]
    second = session.generate(model, tokenizer, [context], sampling=sampling, seed=2, backend="hf")
    expected = generate(model, tokenizer, [context], sampling=sampling, seed=2, backend="hf")
    assert session.resumed == 0 and not session.kept
    assert torch.equal(second.completion_ids, expected.completion_ids) and torch.equal(second.logprobs, expected.logprobs)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch_ops", "kernels"])
@pytest.mark.parametrize("name", ["llama-untied-gqa4", "qwen3-qk-norm"])
def test_resumed_rows_read_the_logits_of_a_fresh_prefill(name, use_kernels):
    """Decoder level, grouped-query and q/k-norm attention, both decode paths: three rows end a turn at
    different steps (each exported as it leaves the cache), then read ragged new tokens on top and
    decode two more; every logit equals a fresh prefill of the whole context and the same decodes."""
    from tests.test_rollout_decoders import build

    from posttrain.rollout import kernels
    from posttrain.rollout.engine import _left_pad
    from posttrain.rollout.llama_decoder import LlamaDecoder

    if use_kernels and kernels.load() is None:
        pytest.skip("no C compiler for the rollout kernels")
    model = build(name)
    prompts, ends = [[5, 17, 33, 8, 9, 60, 4], [70, 71, 72], [11, 12, 13, 14]], [1, 4, 2]  # row r ends after ends[r] decodes
    turn = torch.randint(4, 101, (3, 4), generator=torch.Generator().manual_seed(0))  # fed tokens, (rows, steps)
    decoder = LlamaDecoder(model, use_kernels=use_kernels)
    decoder.prefill(*_left_pad(prompts, 0, 7), 7 + 8, max_rows=3)
    caches, rows = [None] * 3, [0, 1, 2]
    for step in range(5):
        ended = [j for j, r in enumerate(rows) if ends[r] == step]
        for j, cache in zip(ended, decoder.export(ended)):
            caches[rows[j]] = cache
        still = [j for j, r in enumerate(rows) if ends[r] > step]
        if not still:
            break
        if len(still) < len(rows):
            decoder.select(torch.tensor(still))
            rows = [rows[j] for j in still]
        decoder.decode(turn[rows, step])
    # Each context: the prompt, the tokens decoded, then ragged new ids (the engine's first is the row's pending token).
    new = [[40 + r] * (2 * r + 1) for r in range(3)]
    contexts = [prompts[r] + turn[r, :ends[r]].tolist() + new[r] for r in range(3)]
    new_ids, new_mask = _left_pad(new, 0, max(map(len, new)))
    resumed = [decoder.resume(caches, new_ids, new_mask, 4, max_rows=3)]
    fresh = LlamaDecoder(model, use_kernels=use_kernels)
    width = max(map(len, contexts))
    expected = [fresh.prefill(*_left_pad(contexts, 0, width), width + 4, max_rows=3)]
    for token in ([3, 4, 5], [6, 7, 8]):
        resumed.append(decoder.decode(torch.tensor(token)))
        expected.append(fresh.decode(torch.tensor(token)))
    for got, want in zip(resumed, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch_ops", "kernels"])
def test_rows_that_share_a_prompt_share_it_again_after_resume(use_kernels):
    """Two prompts x G = 3 rows (`select` repeats each prompt's cache, as `generate` does): the rows end
    turn 1 at different steps; each group's prompt is exported once (one `SharedPrefix` object for the
    group, only the row's own columns per row), and after `resume` the group's rows share its columns
    again (`kernels.Sharing`: 2 groups, the prompt in whole 16-column tiles). Twice (turns 2 and 3):
    resume ragged new tokens, decode two steps; every logit equals a fresh prefill of the whole context
    and the same decodes, and the rows, ending the turn at different steps again, export the same
    prefix objects."""
    from tests.test_rollout_decoders import build

    from posttrain.rollout import kernels
    from posttrain.rollout.engine import _left_pad
    from posttrain.rollout.llama_decoder import LlamaDecoder

    if use_kernels and kernels.load() is None:
        pytest.skip("no C compiler for the rollout kernels")
    model = build("llama-untied-gqa4")
    prompts, G = [[5, 17, 33, 8, 9, 60, 4, 21, 22, 23], [70, 71, 72]], 3
    generator = torch.Generator().manual_seed(0)
    decoder = LlamaDecoder(model, use_kernels=use_kernels)
    decoder.prefill(*_left_pad(prompts, 0, 10), 10 + 6, max_rows=6)
    decoder.select(torch.arange(2).repeat_interleave(G))
    contexts = [list(prompts[r // G]) for r in range(6)]

    def turn(ends, steps):
        """Decode until each row's end (steps fed: (rows, steps)), exporting every row as it ends."""
        caches, rows = [None] * 6, list(range(6))
        for step in range(steps.shape[1] + 1):
            ended = [j for j, r in enumerate(rows) if ends[r] == step]
            for j, cache in zip(ended, decoder.export(ended)):
                caches[rows[j]] = cache
            still = [j for j, r in enumerate(rows) if ends[r] > step]
            if not still:
                return caches
            if len(still) < len(rows):
                decoder.select(torch.tensor(still))
                rows = [rows[j] for j in still]
            decoder.decode(steps[rows, step])
            for r in rows:
                contexts[r].append(int(steps[r, step]))

    caches = turn([1, 4, 2, 3, 1, 2], torch.randint(4, 101, (6, 4), generator=generator))
    prefixes = [cache.prefix for cache in caches]
    assert prefixes[0] is prefixes[1] is prefixes[2] and prefixes[3] is prefixes[4] is prefixes[5]
    assert prefixes[0].keys.shape[-1] == 10 and prefixes[3].keys.shape[-1] == 3 and prefixes[0] is not prefixes[3]
    assert [cache.keys.shape[-1] for cache in caches] == [1, 4, 2, 3, 1, 2]  # own columns: the tokens fed after the prompt
    for _ in range(2):
        new = [[40 + r] * (1 + r % 3) for r in range(6)]
        for r in range(6):
            contexts[r] += new[r]
        resumed = [decoder.resume(caches, *_left_pad(new, 0, 3), 4, max_rows=6)]
        assert decoder.sharing.groups == 2 and decoder.sharing.shared == 16
        group_of = decoder.sharing.group_of
        assert len(set(group_of[:3])) == len(set(group_of[3:])) == 1 and group_of[0] != group_of[3]
        fresh = LlamaDecoder(model, use_kernels=use_kernels)
        width = max(map(len, contexts))
        expected = [fresh.prefill(*_left_pad(contexts, 0, width), width + 4, max_rows=6)]
        for tokens in ([3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]):
            resumed.append(decoder.decode(torch.tensor(tokens)))
            expected.append(fresh.decode(torch.tensor(tokens)))
        for got, want in zip(resumed, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=LOGPROB_TOLERANCE)
        # The two decodes begin the next turn, which the rows end at different steps again.
        for r in range(6):
            contexts[r] += [3 + r, 9 + r]
        caches = turn([1, 1, 2, 1, 2, 2], torch.randint(4, 101, (6, 2), generator=generator))
        assert all(cache.prefix is prefix for cache, prefix in zip(caches, prefixes))
