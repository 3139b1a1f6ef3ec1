"""Tool episodes (`rollout/episodes.py`, `rollout/transcripts.py`): a scripted policy emits a tool call and then an answer, so
every mask, observation, count and gradient is known by hand, without any learning."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from posttrain.algorithms.logprobs import token_logprobs
from posttrain.algorithms.policy import aggregate, clipped_surrogate
from posttrain.errors import UserError
from posttrain.models.forward import completion_logits
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
from posttrain.rewards.verdict import Verdict
from posttrain.rollout import Rollout, SamplingConfig, generate
from posttrain.rollout.episodes import EpisodeSampler, ToolSettings
from posttrain.rollout.transcripts import TRUNCATION_MARKER, ObservationFormat, episode_metrics, episode_verdicts, truncate_middle

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
ANSWER = "The answer is 5."
PROMPT = "What is 2+3?"


@dataclass
class Result:
    content: str
    status: str = "ok"
    reason: str = ""


class FakeToolbox:
    """Answers every call with `content` (or per-call results from `results`), recording the calls."""

    def __init__(self, content="5", status="ok"):
        self.content, self.status, self.calls = content, status, []

    def schemas(self):
        return [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object", "properties": {}}}}]

    def execute(self, calls):
        self.calls += list(calls)
        out = []
        for call in calls:
            if call.error:
                out.append(Result(f"error: {call.error}", "parse_error"))
            else:
                out.append(Result(self.content, self.status, "sandbox died" if self.status == "infra_error" else ""))
        return out


def scripted(script, eos=True):
    """A `generate` stand-in: row text = script(context text, row); each turn ends with the EOS.
    Log-prob of the t-th token of a turn: -(t + 1) / 100, so placements can be checked."""

    def fake_generate(policy, tokenizer, prompts, *, group_size=1, sampling=None, seed=0, shard=None, draws=None):
        contexts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
        prompt_lists = [tokenizer(c, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
                        for c, p in zip(contexts, prompts)]
        rows, texts = [], []
        for index, context in enumerate(contexts):
            for g in range(group_size):
                text = script(context, index * group_size + g)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
                rows.append(ids)
                texts.append(text)
        N, T = len(rows), max(len(r) for r in rows)
        P = max(len(p) for p in prompt_lists)
        pad = tokenizer.pad_token_id
        prompt_ids = torch.full((N, P), pad)
        prompt_mask = torch.zeros((N, P), dtype=torch.bool)
        completion = torch.full((N, T), pad)
        mask = torch.zeros((N, T), dtype=torch.bool)
        logprobs = torch.zeros(N, T)
        for i, ids in enumerate(rows):
            p = prompt_lists[i // group_size]
            prompt_ids[i, P - len(p):] = torch.tensor(p)
            prompt_mask[i, P - len(p):] = True
            completion[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = True
            logprobs[i, :len(ids)] = -torch.arange(1, len(ids) + 1) / 100
        return Rollout(prompt_ids=prompt_ids, prompt_attention_mask=prompt_mask, completion_ids=completion, mask=mask,
                       sampler_logprobs=logprobs.clone(), logprobs=logprobs, finished=torch.full((N,), eos),
                       truncated=torch.full((N,), not eos), texts=texts,
                       prompt_index=torch.arange(len(contexts)).repeat_interleave(group_size), group_size=group_size,
                       sampling=sampling or SamplingConfig(), pad_token_id=pad)

    return fake_generate


def call_then_answer(context, row):
    return ANSWER if "<|im_start|>tool" in context else CALL


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_model()[0]


def rendered(tokenizer, prompt=PROMPT):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)


def run(tokenizer, model, script=call_then_answer, toolbox=None, group_size=1, prompts=(PROMPT,), **settings):
    toolbox = toolbox or FakeToolbox()
    sampler = EpisodeSampler(tokenizer, toolbox, ToolSettings(names=["add"], **settings), generate_fn=scripted(script))
    return sampler(model, tokenizer, [None] * len(prompts), [rendered(tokenizer, p) for p in prompts], group_size=group_size,
                   sampling=SamplingConfig(max_new_tokens=96), seed=0)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_loss_mask_is_the_models_tokens_then_the_observation_masked_then_the_answer(tokenizer, model):
    rollout = run(tokenizer, model)
    k = len(encode(tokenizer, CALL)) + 1  # the call and the EOS that closed the turn
    observation = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"  # the template's glue after the EOS
    m = len(encode(tokenizer, observation))
    j = len(encode(tokenizer, ANSWER)) + 1
    assert m == 1 + 1 + 5 + 1 + 1 + 1 + 1 + 10  # \n, <|im_start|>, "tool\n", "5", <|im_end|>, \n, <|im_start|>, "assistant\n"
    assert rollout.mask[0].tolist() == [True] * k + [False] * m + [True] * j
    assert rollout.attention[0].tolist() == [True] * (k + m + j)
    assert rollout.completion_ids[0, k:k + m].tolist() == encode(tokenizer, observation)
    # log-probs: the model's, where it wrote; 0 on the observation
    expected = [-(t + 1) / 100 for t in range(k)] + [0.0] * m + [-(t + 1) / 100 for t in range(j)]
    assert rollout.logprobs[0].tolist() == pytest.approx(expected)
    assert rollout.texts == [ANSWER]
    episode = rollout.episodes[0]
    assert (episode["turns"], episode["tool_calls"], episode["tool_failures"], episode["parse_errors"]) == (2, 1, 0, 0)
    assert [entry["role"] for entry in episode["transcript"]] == ["assistant", "tool", "assistant"]
    metrics = episode_metrics(rollout)
    assert metrics["turns/mean"] == 2 and metrics["tools/calls"] == 1
    assert metrics["tokens/observation_fraction"] == pytest.approx(m / (k + m + j))


def test_the_concatenated_ids_are_the_chat_template_of_the_whole_conversation(tokenizer, model):
    rollout = run(tokenizer, model)
    ids = rollout.prompt_ids[0][rollout.prompt_attention_mask[0]].tolist() + rollout.completion_ids[0][rollout.attention[0]].tolist()
    whole = tokenizer.apply_chat_template([
        {"role": "user", "content": PROMPT}, {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": ANSWER}], tokenize=False)
    assert whole.endswith("<|im_end|>\n")
    assert ids == encode(tokenizer, whole[:-1])  # the template's last newline follows the model's final EOS


def test_max_turns_one_ends_after_the_first_call_and_counts_it(tokenizer, model):
    toolbox = FakeToolbox()
    rollout = run(tokenizer, model, toolbox=toolbox, max_turns=1)
    assert toolbox.calls == []  # the call of the last turn is not run
    assert rollout.mask[0].all() and rollout.texts == [CALL]
    assert rollout.episodes[0]["max_turns_hit"] and episode_metrics(rollout)["episodes/max_turns_hit"] == 1
    assert not rollout.truncated[0]


def test_a_malformed_call_is_an_error_observation_and_the_episode_goes_on(tokenizer, model):
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>'
    rollout = run(tokenizer, model, script=lambda context, row: ANSWER if "<|im_start|>tool" in context else bad)
    episode = rollout.episodes[0]
    assert episode["parse_errors"] == 1 and episode["turns"] == 2
    tool = episode["transcript"][1]
    assert tool["status"] == "parse_error" and tool["content"].startswith("error:")
    assert rollout.texts == [ANSWER]
    assert episode_metrics(rollout)["tools/parse_errors"] == 1


def test_a_dying_sandbox_makes_the_row_infra_error_with_advantage_zero(tokenizer, model):
    from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
    from posttrain.rewards.scores import Scores

    toolbox = FakeToolbox(status="infra_error")
    # row 0 calls the broken tool; rows 1-3 answer at once
    rollout = run(tokenizer, model, script=lambda context, row: CALL if row == 0 and "<|im_start|>tool" not in context else ANSWER,
                  toolbox=toolbox, group_size=4)
    assert rollout.episodes[0]["infra_error"] == "tool sandbox died"
    verdicts = episode_verdicts(rollout, [Verdict.ok(r, "scripted") for r in (1.0, 1.0, 0.0, 0.0)])
    assert verdicts[0].status == "infra_error" and verdicts[1].reward == 1.0
    scores = Scores.of(verdicts)
    assert scores.infra_errors == 1
    mask = rollout.mask & ~torch.isnan(scores.rewards)[:, None]
    from posttrain.losses.policy_gradient_config import Loss

    estimate = ADVANTAGE_ESTIMATORS["group"].estimate(StepRewards(scores.rewards, mask, rollout.mask, 4),
                                                      **Loss().estimator_settings())
    assert float(estimate.advantages[0].abs().max()) == 0.0
    assert episode_metrics(rollout)["episodes/infra_errors"] == 1


def test_a_long_observation_keeps_exactly_the_cap_with_head_tail_and_marker(tokenizer, model):
    content = "".join(str(i % 10) for i in range(1000))
    assert len(encode(tokenizer, content)) == 1000
    rollout = run(tokenizer, model, toolbox=FakeToolbox(content=content), max_observation_tokens=256)
    glue = len(encode(tokenizer, "\n<|im_start|>tool\n")), len(encode(tokenizer, "<|im_end|>\n<|im_start|>assistant\n"))
    k = len(encode(tokenizer, CALL)) + 1
    observation = ~rollout.mask[0] & rollout.attention[0]
    assert int(observation.sum()) == glue[0] + 256 + glue[1]
    kept = tokenizer.decode(rollout.completion_ids[0, k + glue[0]:k + glue[0] + 256].tolist())
    marker = TRUNCATION_MARKER
    head = (256 - len(marker) + 1) // 2
    assert kept == content[:head] + marker + content[1000 - (256 - len(marker) - head):]
    assert rollout.episodes[0]["observations_truncated"] == 1
    ids, cut = truncate_middle(list(range(10)), 10, [99])
    assert ids == list(range(10)) and not cut


def test_max_episode_tokens_cuts_a_turn_or_an_observation_that_passes_it(tokenizer, model):
    """Budget 20 < the call's 69 tokens (70 with the EOS): the turn is cut to 20 and the row truncated,
    whether it ended with the EOS or ran out of max_new_tokens; budget call + 5: the observation is
    cut after its 5th token and no turn 2 is drawn."""
    call = len(encode(tokenizer, CALL)) + 1
    for eos in (True, False):
        sampler = EpisodeSampler(tokenizer, FakeToolbox(), ToolSettings(names=["add"], max_episode_tokens=20),
                                 generate_fn=scripted(call_then_answer, eos=eos))
        rollout = sampler(model, tokenizer, [None], [rendered(tokenizer)], group_size=1, sampling=SamplingConfig(max_new_tokens=96), seed=0)
        assert int(rollout.completion_attention_mask.sum()) == 20 and int(rollout.mask.sum()) == 20 and bool(rollout.truncated[0])
    rollout = run(tokenizer, model, max_episode_tokens=call + 5)
    assert int(rollout.completion_attention_mask.sum()) == call + 5 and int(rollout.mask.sum()) == call
    assert bool(rollout.truncated[0]) and rollout.episodes[0]["turns"] == 1


# The model's positions: the set-up check (`data.context.check_prompts_fit`) sees the first turn only;
# later turns add observations, and a context past max_position_embeddings (the tiny model: 1,024)
# is read at positions the model never learned. The episode ends at the limit instead, truncated.
def counting(generate_fn):
    """`generate_fn`, recording each call's context lengths (strings: turn 1's rendered prompts)."""
    contexts = []

    def counted(policy, tokenizer, prompts, **kwargs):
        contexts.append([None if isinstance(p, str) else len(p) for p in prompts])
        return generate_fn(policy, tokenizer, prompts, **kwargs)

    counted.contexts = contexts
    return counted


def test_an_observation_past_the_models_positions_ends_the_episode_at_the_limit_truncated(tokenizer, model):
    """Prompt 31 + call 70 + a 1,500-token observation > 1,024: the completion is cut to
    1,024 - 31 = 993 tokens (the call, then the observation's head), the row truncated, no turn 2."""
    limit, prompt = model.config.max_position_embeddings, len(encode(tokenizer, rendered(tokenizer)))
    generate_fn = counting(scripted(call_then_answer))
    sampler = EpisodeSampler(tokenizer, FakeToolbox(content="7" * 1500), ToolSettings(names=["add"], max_observation_tokens=2000),
                             generate_fn=generate_fn)
    rollout = sampler(model, tokenizer, [None], [rendered(tokenizer)], group_size=1, sampling=SamplingConfig(max_new_tokens=96), seed=0)
    call = len(encode(tokenizer, CALL)) + 1
    assert generate_fn.contexts == [[None]]  # turn 2 never drawn
    assert int(rollout.completion_attention_mask.sum()) == limit - prompt
    assert int(rollout.mask.sum()) == call and not rollout.mask[0, call:].any()
    assert bool(rollout.truncated[0]) and not bool(rollout.finished[0])
    assert rollout.episodes[0]["turns"] == 1 and rollout.episodes[0]["tool_calls"] == 1


def test_a_later_turn_the_real_engine_draws_past_the_models_positions_is_cut_at_the_limit(tokenizer, model):
    """Turn 2 is the tiny model's own (`generate`) from a context 10 tokens short of the limit: it
    writes 45 tokens, of which the 10 that fit are kept, and the row is truncated."""
    limit, prompt = model.config.max_position_embeddings, len(encode(tokenizer, rendered(tokenizer)))
    call = len(encode(tokenizer, CALL)) + 1
    glue = len(ObservationFormat(tokenizer).ids([""], ["add"], True, 2000)[0])
    script = scripted(call_then_answer)
    generate_fn = counting(lambda policy, tokenizer, prompts, **kwargs: (script if isinstance(prompts[0], str) else generate)(
        policy, tokenizer, prompts, **kwargs))
    content = "7" * (limit - 10 - prompt - call - glue)
    sampler = EpisodeSampler(tokenizer, FakeToolbox(content=content), ToolSettings(names=["add"], max_observation_tokens=2000),
                             generate_fn=generate_fn)
    rollout = sampler(model, tokenizer, [None], [rendered(tokenizer)], group_size=1, sampling=SamplingConfig(max_new_tokens=96), seed=0)
    assert generate_fn.contexts == [[None], [limit - 10]]
    assert int(rollout.completion_attention_mask.sum()) == limit - prompt
    assert int(rollout.mask.sum()) == call + 10 and rollout.mask[0, limit - prompt - 10:limit - prompt].all()
    assert bool(rollout.truncated[0]) and rollout.episodes[0]["turns"] == 2


def test_the_observation_gets_exactly_zero_gradient_and_the_models_tokens_the_single_turn_gradient(tokenizer, model):
    rollout = run(tokenizer, model)
    inputs, P, T = rollout.forward_inputs(), rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    _, logits = completion_logits(model, inputs, slice(0, 1), P, T, shared_prefix=False)
    logits.retain_grad()
    logprobs = token_logprobs(logits, rollout.completion_ids, 1.0)
    old, advantages = logprobs.detach(), torch.tensor([0.7])
    per_token, _ = clipped_surrogate(logprobs, old, advantages[:, None].expand_as(logprobs))
    aggregate(per_token, rollout.mask).backward()
    observation = rollout.attention[0] & ~rollout.mask[0]
    assert logits.grad[0, observation].abs().max().item() == 0.0
    # The same loss computed naively on the model's tokens alone, packed into one single-turn row.
    packed = logprobs.detach()[0, rollout.mask[0]].clone().requires_grad_(True)
    naive, _ = clipped_surrogate(packed[None], packed.detach()[None], torch.full((1, packed.numel()), 0.7))
    naive.mean().backward()
    probs = torch.softmax(logits.detach()[0, rollout.mask[0]], -1)
    one_hot = torch.nn.functional.one_hot(rollout.completion_ids[0, rollout.mask[0]], probs.shape[-1]).float()
    expected = packed.grad[:, None] * (one_hot - probs)  # d logp / d logits = onehot - softmax
    torch.testing.assert_close(logits.grad[0, rollout.mask[0]], expected, rtol=1e-5, atol=1e-8)


def test_a_row_without_a_tool_call_is_the_single_turn_rollout(tokenizer, model):
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    prompts = [rendered(tokenizer, "1+1="), rendered(tokenizer, "2+2=")]
    single = generate(model, tokenizer, prompts, group_size=2, sampling=sampling, seed=3)
    sampler = EpisodeSampler(tokenizer, FakeToolbox(), ToolSettings(names=["add"]))
    episodes = sampler(model, tokenizer, [None, None], prompts, group_size=2, sampling=sampling, seed=3)
    width = single.completion_ids.shape[1]
    assert torch.equal(episodes.completion_ids[:, :width], single.completion_ids)
    assert torch.equal(episodes.mask[:, :width], single.mask) and torch.equal(episodes.attention, episodes.mask)
    assert torch.equal(episodes.logprobs[:, :width], single.logprobs)
    assert episodes.texts == single.texts and all(e["turns"] == 1 for e in episodes.episodes)


def test_generate_draws_give_a_row_the_same_tokens_in_any_subset(tokenizer, model):
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0)
    prompts = [rendered(tokenizer, f"{i}+1=") for i in range(5)]
    whole = generate(model, tokenizer, prompts, sampling=sampling, seed=11, draws=(range(5), 5))
    part = generate(model, tokenizer, [prompts[3], prompts[1]], sampling=sampling, seed=11, draws=([3, 1], 5))
    assert part.texts == [whole.texts[3], whole.texts[1]]
    assert whole.texts == generate(model, tokenizer, prompts, sampling=sampling, seed=11).texts
    with pytest.raises(UserError, match="draws"):
        generate(model, tokenizer, prompts[:2], sampling=sampling, seed=11, draws=([0, 7], 5))


def test_templates_that_rewrite_earlier_turns_are_refused_in_one_line():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (  # drops every earlier assistant turn once a tool message follows (prefix not kept)
        "{% for m in messages %}{% if not (m['role'] == 'assistant' and not loop.last and messages[-1]['role'] == 'tool') %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(UserError, match="preserves prefixes"):
        ObservationFormat(tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(UserError, match="chat template"):
        ObservationFormat(tokenizer)


def test_settings_are_checked_in_one_line():
    with pytest.raises(UserError, match="tools.max_turns"):
        ToolSettings(names=["add"], max_turns=0).validate()
    with pytest.raises(UserError, match="twice"):
        ToolSettings(names=["add", "add"]).validate()


# ---------------------------------------------------------------------------------------------
# Through the online recipe: a real GRPO / PPO step on scripted episodes, with the real `add` tool.
SMALL = {
    "model": "tiny", "reward": "exact",
    "data": {"eval_size": 8, "train_size": 200, "prompts_per_step": 2, "group_size": 4},
    "sampling": {"max_new_tokens": 96}, "update": {"micro_batch_size": 8},
    "tools": {"names": ["add"], "max_turns": 3},
}


def _answer_with_the_tool(context, row):
    """Call add on the prompt's numbers, then answer with what the tool said (rows of odd index answer wrong)."""
    import re

    if "<|im_start|>tool" not in context:
        a, b = re.findall(r"(\d+)\+(\d+)=", context)[-1]
        return f'<tool_call>{{"name": "add", "arguments": {{"a": {int(a)}, "b": {int(b)}}}}}</tool_call>'
    result = re.findall(r"<\|im_start\|>tool\n(-?\d+)<\|im_end\|>", context)[-1]
    return f"<answer>{result}</answer>" if row % 2 == 0 else "<answer>0</answer>"


@pytest.mark.parametrize("advantage", ["group", "gae"])
def test_an_online_step_trains_on_tool_episodes_with_the_real_tool(tmp_path, advantage):
    from posttrain.config import build_config
    from posttrain.recipes import online, online_config

    overrides = {**SMALL, "output_dir": str(tmp_path / "run"), "loss": {"advantage": advantage}}
    if advantage == "gae":
        overrides["data"] = {**SMALL["data"], "group_size": 1, "prompts_per_step": 4}
    config = build_config(online_config.Config, None, overrides)
    state = online.setup(config)
    assert isinstance(state.sampler, EpisodeSampler) and state.sampler.toolbox.names == ["add"]
    state.sampler.generate = scripted(_answer_with_the_tool)
    batch = online.sample(state)
    episodes = batch.rollout.episodes
    assert all(e["turns"] == 2 and e["tool_calls"] == 1 and e["tool_failures"] == 0 for e in episodes)
    assert all(e["transcript"][1]["status"] == "ok" for e in episodes)
    assert "<|im_start|>tool" not in batch.rendered[0]  # the tiny template ignores tools= ...
    assert batch.rendered[0].startswith("<|im_start|>system\nYou may call tools.")  # ... so they are described in a system message
    even = torch.arange(len(episodes)) % 2 == 0
    assert batch.scores.rewards[even].eq(1).all() and batch.scores.rewards[~even].eq(0).all()
    metrics = {**batch.metrics(), **online.step(state, batch)}
    assert metrics["turns/mean"] == 2 and metrics["tools/calls"] == 1
    assert 0 < metrics["tokens/observation_fraction"] < 1
    assert all(torch.isfinite(torch.tensor(value)) for key, value in metrics.items() if key.startswith("loss") and value is not None)
    assert metrics["mismatch/logprob_abs_mean"] > 0  # on the model's tokens only: the scripted log-probs are not the model's
    rows = batch.sample_rows(2)
    assert rows[0]["turns"] == 2 and "[tool add ok]" in rows[0]["transcript"] and rows[0]["transcript"].startswith("[model] <tool_call>")


def test_episodes_ended_at_the_models_positions_count_in_truncated_fraction(tmp_path):
    """Through the online recipe: every row's observation (1,500 tokens after a prompt of about 600)
    passes the tiny model's 1,024 positions, so every row is truncated and never longer than the limit."""
    from posttrain.config import build_config
    from posttrain.recipes import online, online_config

    overrides = {**SMALL, "output_dir": str(tmp_path / "run"), "tools": {**SMALL["tools"], "max_observation_tokens": 2000}}
    state = online.setup(build_config(online_config.Config, None, overrides))
    state.sampler.generate, state.sampler.toolbox = scripted(_answer_with_the_tool), FakeToolbox(content="7" * 1500)
    batch = online.sample(state)
    positions = batch.rollout.prompt_attention_mask.sum(-1) + batch.rollout.completion_attention_mask.sum(-1)
    assert positions.eq(state.policy.config.max_position_embeddings).all()
    assert batch.metrics()["truncated_fraction"] == 1.0
    assert all(e["turns"] == 1 for e in batch.rollout.episodes)


def test_sft_on_a_tool_transcript_trains_the_assistant_turns_and_never_the_tool_result():
    from posttrain.data.examples import Example
    from posttrain.data.sft_data import SFTRow, tokenize_sft
    from posttrain.data.tokenize import render_prompt
    from posttrain.recipes.tool_demo import tool_transcripts
    from posttrain.rollout.tools import tool_schemas

    tokenizer = build_tiny_tokenizer()
    row = tool_transcripts([Example(id="x", prompt="12+345=", answer="357")])[0]
    def spans(tools):
        batch = tokenize_sft(tokenizer, [SFTRow("x", messages=row["messages"])], tools=tools)
        ids, mask = batch.input_ids[0].tolist(), batch.mask[0].tolist()
        return tokenizer.decode([i for i, m in zip(ids, mask) if m]), tokenizer.decode([i for i, m in zip(ids, mask) if not m])

    trained, untrained = spans(None)
    assert trained == '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 345}}</tool_call><|im_end|><answer>357</answer><|im_end|>'
    assert untrained == "<|im_start|>user\n12+345=<|im_end|>\n<|im_start|>assistant\n\n<|im_start|>tool\n357<|im_end|>\n<|im_start|>assistant\n\n"
    # With the tools' schemas the transcript is told of them exactly as an episode's prompt is (the tiny
    # template ignores tools=: a system message), and still trains on the assistant turns only.
    schemas = tool_schemas(["add"])
    told_trained, told_untrained = spans(schemas)
    assert told_trained == trained
    assert told_untrained == render_prompt(tokenizer, "12+345=", tools=schemas) + "\n<|im_start|>tool\n357<|im_end|>\n<|im_start|>assistant\n\n"
    # The episode sampler's observation for the same turn is exactly the untrained span between the two turns.
    observation = ObservationFormat(tokenizer).ids(["357"], ["add"], after_eos=True, cap=256)[0]
    assert tokenizer.decode(observation) == "\n<|im_start|>tool\n357<|im_end|>\n<|im_start|>assistant\n"


def test_bad_tool_calls_in_sft_rows_are_one_line_each():
    from posttrain.data.sft_data import parse_sft_row
    from posttrain.data.validation import ValidationReport

    def problems(messages):
        report = ValidationReport("t.jsonl")
        parse_sft_row(report, 1, {"messages": messages}, "t.jsonl")
        return [f"{problem.field}: {problem.reason}" for problem in report.problems]

    user = {"role": "user", "content": "1+2="}
    assert problems([user, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
                     {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]) == []
    assert problems([user, {"role": "user", "content": "", "tool_calls": [{"function": {"name": "add"}}]},
                     {"role": "assistant", "content": "3"}]) == ["messages[1].tool_calls: only assistant messages make tool calls, this one is 'user'"]
    assert problems([user, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": "{bad"}}]}])[0].startswith(
        "messages[1].tool_calls[0].arguments: not JSON")
    assert problems([user, {"role": "assistant", "content": "", "tool_calls": []}]) == [
        "messages[1].tool_calls: wrong type: expected a non-empty list of calls, got list"]


# ---------------------------------------------------------------------------------------------
# The command line: eval and grpo with tools on the tiny model (random weights: whatever it writes).
def test_eval_with_tools_keeps_each_transcript_and_counts(tmp_path, capsys):
    import json

    from posttrain.cli import main

    out = tmp_path / "eval"
    assert main(["eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "4", "--max-new-tokens", "8",
                 "--tools.names", "[add]", "--tools.max_turns", "2", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tools add: 1.00 turns and 0.00 calls per problem" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tools"] == {"names": ["add"], "max_turns": 2}
    assert summary["episodes"]["turns/mean"] == 1.0 and summary["episodes"]["episodes/infra_errors"] == 0
    rows = json.loads((out / "eval.json").read_text())["rows"]
    assert len(rows) == 4 and all(row["transcript"].startswith("[model] ") and row["turns"] == 1 for row in rows)
    assert "<tools>" in rows[0]["prompt"]  # the tiny template ignores tools=: they are described in a system message


def test_grpo_with_tools_runs_from_the_command_line_and_its_card_names_them(tmp_path, capsys):
    import json

    from posttrain.cli import main

    out = tmp_path / "grpo"
    assert main(["grpo", "--model", "tiny", "--max-steps", "1", "--output-dir", str(out), "--reward", "exact",
                 "--data.eval_size", "4", "--data.prompts_per_step", "2", "--data.group_size", "2",
                 "--sampling.max_new_tokens", "8", "--tools.names", "[add]", "--tools.max_turns", "2"]) == 0
    card = json.loads((out / "run_card.json").read_text())
    episodes = card["links"]["data"]["episodes"]
    assert episodes["tools"]["add"]["kind"] and episodes["max_turns"] == 2
    assert episodes["observation_tokens"] == "attended, never trained (loss mask False)"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("turns/mean" in row for row in metrics)


@pytest.mark.parametrize("command", ["grpo", "eval"])
def test_tools_described_past_the_models_positions_are_refused_before_any_work(command, tmp_path, capsys):
    """The README's old example on the tiny model (issue 40, item 2): `add` and `calculator` described
    to each prompt make it 1,059 tokens of the model's 1,024 positions; it ran, and the model wrote
    garbage. Now one line before any sampling, naming the prompt, the limit and the tools; no directory."""
    import re

    from posttrain.cli import main

    out = tmp_path / "out"
    argv = (["grpo", "--model", "tiny", "--max-steps", "1", "--reward", "exact", "--data.eval_size", "4", "--data.train_size", "50",
             "--data.prompts_per_step", "2", "--data.group_size", "2", "--sampling.max_new_tokens", "48"] if command == "grpo" else
            ["eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "4", "--max-new-tokens", "48"])
    assert main([*argv, "--tools.names", "[add, calculator]", "--output-dir", str(out)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain")]
    split, budget = ("training", "sampling") if command == "grpo" else ("held-out", "acceptance")
    assert len(err) == 1 and re.fullmatch(
        f"posttrain: error: the longest {split} prompt \\(example arithmetic-(train|eval)-\\d+\\) is 1,059 tokens, and with "
        f"{budget}.max_new_tokens 48 it needs 1,107 positions, more than the model's 1,024 \\(max_position_embeddings\\); they go to "
        "the tools' descriptions \\(add, calculator\\) 1,034, the answer 48, the prompt itself 25: name fewer tools, or "
        "tools.describe none for a model that learned its tools from transcripts \\(posttrain demo --tools\\)", err[0]), err
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--tools.names", "[nope]"], "nope"),
    (["--tools.names", "[add]", "--tools.max_turns", "0"], "tools.max_turns must be at least 1"),
])
def test_tool_mistakes_are_one_line(tmp_path, capsys, argv, message):
    from posttrain.cli import main

    code = main(["grpo", "--model", "tiny", "--max-steps", "1", "--output-dir", str(tmp_path / "x"), "--reward", "exact", *argv])
    assert code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "x").exists()


def drawn():
    """A `generate` stand-in whose rows depend on their draws, as the real engine's do: a row's
    uniform number (from the table `generate` would draw for (seed, its place in the whole batch))
    decides whether it calls the tool (u < 0.6) and with which numbers."""
    def fake_generate(policy, tok, prompts, *, group_size=1, sampling=None, seed=0, shard=None, draws=None):
        if draws is not None:
            indices, total = list(draws[0]), draws[1]
        else:
            first, total = shard if shard is not None else (0, len(prompts))
            indices = range(first, first + len(prompts))
        table = torch.rand(total * group_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        u = [float(table[i * group_size + g]) for i in indices for g in range(group_size)]

        def script(context, row):
            if u[row] < 0.6 and "<|im_start|>tool" not in context:
                return f'<tool_call>{{"name": "add", "arguments": {{"a": {int(u[row] * 1000)}, "b": {int(u[row] * 37) % 10}}}}}</tool_call>'
            return f"<answer>{int(u[row] * 100)}</answer>"

        return scripted(script)(policy, tok, prompts, group_size=group_size, sampling=sampling, seed=seed, shard=shard, draws=draws)

    return fake_generate


def test_a_shard_of_the_prompts_samples_exactly_its_rows_of_the_whole_batch(tokenizer, model):
    """What torchrun's ranks rely on: each rank's episodes are the whole batch's rows, turn after turn."""
    from posttrain.rollout.tools import resolve_tools

    sampler = EpisodeSampler(tokenizer, resolve_tools(["add"]), ToolSettings(names=["add"], max_turns=3), generate_fn=drawn())
    prompts = [rendered(tokenizer, f"{i}+{i}=") for i in range(4)]
    sampling = SamplingConfig(max_new_tokens=96)
    whole = sampler(model, tokenizer, [None] * 4, prompts, group_size=2, sampling=sampling, seed=9)
    parts = [sampler(model, tokenizer, [None] * 2, prompts[s:s + 2], group_size=2, sampling=sampling, seed=9, shard=(s, 4))
             for s in (0, 2)]
    assert 0 < sum(e["tool_calls"] for e in whole.episodes) < 8  # some rows called the tool, some did not
    assert [t for part in parts for t in part.texts] == whole.texts
    assert [e for part in parts for e in part.episodes] == whole.episodes
    merged = Rollout.concat([(part, [0, 1]) for part in parts])
    assert torch.equal(merged.completion_ids, whole.completion_ids) and torch.equal(merged.mask, whole.mask)
    assert torch.equal(merged.attention, whole.attention)


# ---------------------------------------------------------------------------------------------
# Environments: one per episode, reset from the row's example, rewards from its steps.
def _guesses(*guesses):
    """Row r guesses guesses[turn] on each turn (the turn read from how many tool results it has seen)."""
    def script(context, row):
        turn = context.count("<|im_start|>tool")
        return f'<tool_call>{{"name": "guess", "arguments": {{"n": {guesses[turn]}}}}}</tool_call>' if turn < len(guesses) else "done"
    return script


def test_an_environment_is_one_instance_per_episode_reset_from_its_example_and_gives_the_reward(tokenizer, model):
    from posttrain.data.examples import Example
    from posttrain.rollout.environments import environment_factory
    from tests.environment_fixtures import Guess

    Guess.resets.clear()
    settings = ToolSettings(environment="tests.environment_fixtures:Guess", reward="environment", step_rewards="sum", max_turns=4)
    sampler = EpisodeSampler(tokenizer, None, settings, generate_fn=scripted(_guesses(50, 20, 30)),
                             environment=environment_factory(settings.environment))
    assert sampler.tools[0]["function"]["name"] == "guess"
    examples = [Example(id="a", prompt="guess", answer="30"), Example(id="b", prompt="guess", answer="7")]
    rollout = sampler(model, tokenizer, examples, [rendered(tokenizer, "guess")] * 2, group_size=2,
                      sampling=SamplingConfig(max_new_tokens=96), seed=0)
    assert len({instance for instance, _ in Guess.resets}) == 4  # one instance per row ...
    assert [answer for _, answer in Guess.resets] == ["30", "30", "7", "7"]  # ... the G rows of a group from the same reset
    first = rollout.episodes[0]
    # 50 -> lower (-0.1), 20 -> higher (-0.1), 30 -> correct (+1, done: its observation is not appended)
    assert [e["content"] for e in first["transcript"] if e["role"] == "tool"] == ["lower", "higher", "correct"]
    assert first["environment_done"] and first["turns"] == 3 and first["reward"] == pytest.approx(0.8)
    assert rollout.mask[0].sum() == int(rollout.attention[0].sum()) - first["observation_tokens"]
    last = int(rollout.attention[0].sum()) - 1
    assert rollout.mask[0, last] and rollout.completion_ids[0, last] == tokenizer.eos_token_id  # "correct" was not appended
    # the other group: 50, 20, 30 all wrong for 7, then "done" without a call: four model turns, three rewards
    second = rollout.episodes[2]
    assert second["turns"] == 4 and not second["environment_done"] and second["reward"] == pytest.approx(-0.3)
    verdicts = episode_verdicts(rollout, [Verdict.ok(0.0, "verifier")] * 4)
    assert [v.reward for v in verdicts] == pytest.approx([0.8, 0.8, -0.3, -0.3])
    assert verdicts[0].details["verifier_reward"] == 0.0


def test_an_environment_step_that_raises_is_an_error_observation_and_no_reward_is_a_data_error(tokenizer, model):
    from posttrain.data.examples import Example
    from posttrain.rollout.environments import environment_factory

    settings = ToolSettings(environment="tests.environment_fixtures:Guess", reward="environment", step_rewards="last", max_turns=2)
    script = lambda context, row: '<tool_call>{"name": "nope", "arguments": {}}</tool_call>' if "tool" not in context else "ok"  # noqa: E731
    sampler = EpisodeSampler(tokenizer, None, settings, generate_fn=scripted(script), environment=environment_factory(settings.environment))
    rollout = sampler(model, tokenizer, [Example(id="a", prompt="g", answer="3")], [rendered(tokenizer, "g")], group_size=1,
                      sampling=SamplingConfig(max_new_tokens=96), seed=0)
    episode = rollout.episodes[0]
    assert episode["tool_failures"] == 1 and episode["transcript"][1]["content"] == "error: ValueError: no tool nope"
    assert episode["reward"] is None
    assert episode_verdicts(rollout, [Verdict.ok(1.0, "")])[0].status == "data_error"


def test_environment_mistakes_are_one_line():
    from posttrain.rollout.environments import environment_factory

    with pytest.raises(UserError, match="step missing"):
        environment_factory("tests.environment_fixtures:NoStep")
    with pytest.raises(UserError, match="cannot import"):
        environment_factory("tests.environment_fixtures:Nothing")
    with pytest.raises(UserError, match="not both"):
        ToolSettings(names=["add"], environment="x:Y").validate()
    with pytest.raises(UserError, match="needs tools.environment"):
        ToolSettings(names=["add"], reward="environment").validate()


def test_sft_refuses_a_template_that_drops_tool_calls_in_one_line():
    """What a model saved with the tiny model's pre-tools template did: its calls rendered as an empty
    assistant turn, so SFT taught it to end the turn at once."""
    from posttrain.data.examples import Example
    from posttrain.data.sft_data import SFTRow, tokenize_sft
    from posttrain.recipes.tool_demo import tool_transcripts

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    row = tool_transcripts([Example(id="x", prompt="1+2=", answer="3")])[0]
    with pytest.raises(UserError, match="does not render an assistant message's tool_calls"):
        tokenize_sft(tokenizer, [SFTRow("x", messages=row["messages"])])


def test_a_key_given_a_value_and_used_as_a_section_is_one_line(tmp_path, capsys):
    from posttrain.cli import main

    code = main(["eval", "--model", "tiny", "--task", "arithmetic", "--tools", "[add]", "--tools.describe", "none",
                 "--output-dir", str(tmp_path / "e")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "--tools is given a value and --tools.describe uses it as a section" in err[0]


def test_the_review_sheet_shows_a_tool_episodes_whole_transcript_escaped():
    from posttrain.evaluation.review import marks_rows, render_sheet, sample_rows

    rows = [{"id": "a", "prompt": "1+2=", "gold": "3", "completion": "<answer>3</answer>", "extracted": "3", "reward": 1.0,
             "status": "ok", "reason": "match", "transcript": '[model] <tool_call>{"name": "add"}</tool_call>\n[tool add ok] 3\n[model] <answer>3</answer>'},
            {"id": "b", "prompt": "2+2=", "gold": "4", "completion": "4", "extracted": "4", "reward": 1.0, "status": "ok", "reason": "match"}]
    sample = sample_rows(rows, 2, seed=0)
    assert sample[0]["transcript"].startswith("[model] <tool_call>") and "transcript" not in sample[1]
    html = render_sheet(sample, marks_rows(sample), "t")
    assert html.count('<pre class="transcript">') == 1
    assert "[tool add ok] 3" in html and "&lt;tool_call&gt;" in html and "<tool_call>" not in html


def test_a_reward_function_sees_the_whole_episode_in_its_row(tmp_path):
    from posttrain.config import build_config
    from posttrain.recipes import online, online_config

    seen = []

    def used_the_tool(completion, example):
        seen.append(example["transcript"])
        return 1.0 if any(entry["role"] == "tool" and entry["status"] == "ok" for entry in example["transcript"]) else 0.0

    config = build_config(online_config.Config, None, {**SMALL, "output_dir": str(tmp_path / "run")})
    state = online.setup(config, reward=used_the_tool)
    state.sampler.generate = scripted(lambda context, row: _answer_with_the_tool(context, row) if row < 4 else "<answer>1</answer>")
    batch = online.sample(state)
    assert batch.scores.rewards.tolist() == [1.0] * 4 + [0.0] * 4  # group 1 called add; group 2 answered at once
    assert [len(t) for t in seen] == [3] * 4 + [1] * 4


def test_the_tool_demo_runs_end_to_end_from_the_command_line(tmp_path, capsys):
    """`posttrain demo --tools`, shortened (an SFT start of 2 steps, a few transcripts and steps):
    every stage runs, the report's table has the three rows with intervals and changes, the plot is
    written, and the start is evaluated without the tool, the tool stages with it."""
    import json

    from posttrain.cli import main

    start = tmp_path / "sft"
    assert main(["sft", "--config", "tiny-sft", "--max-steps", "2", "--checkpoint-every", "2", "--output-dir", str(start),
                 "--data.eval_size", "8", "--acceptance.eval_every", "0"]) == 0
    out = tmp_path / "demo-tools"
    assert main(["demo", "--tools", "--sft-run", str(start), "--output-dir", str(out), "--threads", "1", "--tool-threads", "1",
                 "--eval-size", "8", "--tool-eval-size", "4", "--tool-transcripts", "32", "--tool-sft-steps", "2",
                 "--tool-grpo-steps", "1"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "tool demo" and summary["tool_sft_steps"] == 2 and summary["tool_grpo_steps"] == 1
    assert set(summary["results"]) == {"sft", "tool_sft", "tool_grpo"}
    for stage, entries in summary["results"].items():
        assert set(entries) == {"in_distribution", "digits_3"}
        for entry in entries.values():
            assert entry["n"] <= 4 and entry["ci95"][0] <= entry["pass@1"] <= entry["ci95"][1]
            assert ("episodes" in entry) == (stage != "sft") and ("change" in entry) == (stage != "sft")
    rows = json.loads((out / "eval_tool_sft_digits_3.json").read_text())["rows"]
    assert len(rows) == 4 and all(row["transcript"].startswith("[model] ") for row in rows)
    report = (out / "report.md").read_text()
    assert "| SFT start, no tool |" in report and "| then GRPO with the tool |" in report
    assert (out / "tool_demo.png").is_file()
    assert len((out / "transcripts.jsonl").read_text().splitlines()) == 32
    assert main(["demo", "--tools", "--tool-transcripts", "31"]) == 2
    assert "tool_transcripts must be at least 32" in capsys.readouterr().err
