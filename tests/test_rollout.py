"""The rollout engine on the tiny model: log-probs vs a full forward, greedy vs transformers, layout,
masks, stop conditions, determinism, chunking, and the sampled frequencies."""

import dataclasses

import pytest
import torch

from posttrain.models import build_tiny_model, load_model
from posttrain.rollout import Rollout, SamplingConfig, generate, stop_token_ids
from posttrain.rollout.sampling import sampler_logits

PROMPTS = ["Q: 2+3=?\nA:", "def add(a, b):", "Hello"]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny")
    return model, tokenizer


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_999_DF3 = 16.266  # chi-square critical value, 3 degrees of freedom, p = 0.001


def full_forward_logits(model, rollout: Rollout) -> torch.Tensor:
    """(N, T, V) logits of the completion tokens from one no-cache forward over prompt + completion."""
    inputs = rollout.forward_inputs()
    P, T = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    return logits[:, P - 1:P - 1 + T].float()


def check_logprobs_against_forward(model, rollout: Rollout, atol=1e-4):
    sampling = rollout.sampling
    scaled = full_forward_logits(model, rollout) / sampling.temperature  # (N, T, V)
    tokens = rollout.completion_ids.unsqueeze(-1)
    plain = torch.log_softmax(scaled, -1).gather(-1, tokens).squeeze(-1)
    N, T, V = scaled.shape
    truncated = sampler_logits(scaled.reshape(N * T, V), sampling.top_k, sampling.top_p).view(N, T, V)
    sampler = torch.log_softmax(truncated, -1).gather(-1, tokens).squeeze(-1)
    mask = rollout.mask
    assert torch.allclose(rollout.logprobs[mask], plain[mask], atol=atol)
    assert torch.allclose(rollout.sampler_logprobs[mask], sampler[mask], atol=atol)
    assert (rollout.logprobs[~mask] == 0).all() and (rollout.sampler_logprobs[~mask] == 0).all()


@pytest.mark.parametrize("backend", ["fast", "hf"])
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.7, max_new_tokens=24),
                                      SamplingConfig(temperature=1.3, top_p=0.9, top_k=20, max_new_tokens=24)],
                         ids=["temperature", "top-p-top-k"])
def test_logprobs_equal_a_full_no_cache_forward(tiny, backend, sampling):
    model, tokenizer = tiny
    rollout = generate(model, tokenizer, PROMPTS, group_size=3, sampling=sampling, seed=0, backend=backend)
    check_logprobs_against_forward(model, rollout)
    if sampling.truncates:  # the two log-probs really are different distributions here
        assert (rollout.sampler_logprobs[rollout.mask] > rollout.logprobs[rollout.mask] + 1e-3).float().mean() > 0.5


def test_fast_and_generic_decoders_sample_the_same_tokens(tiny):
    model, tokenizer = tiny
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=20)
    fast = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=3, backend="fast")
    generic = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=3, backend="hf")
    assert torch.equal(fast.completion_ids, generic.completion_ids)
    assert torch.allclose(fast.sampler_logprobs, generic.sampler_logprobs, atol=1e-5)


def hf_greedy(model, tokenizer, prompts, max_new_tokens):
    """transformers' own greedy decoding, left-padded batch; returns per-prompt generated id lists."""
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(i)) + i for i in ids])
    attention_mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
    eos = set(stop_token_ids(model, tokenizer, SamplingConfig()))
    results = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        results.append(row[:end])
    return results


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_greedy_equals_transformers_generate(tiny, backend):
    model, tokenizer = tiny
    sampling = SamplingConfig(greedy=True, max_new_tokens=30)
    rollout = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, backend=backend)
    expected = hf_greedy(model, tokenizer, PROMPTS, 30)
    for row in range(len(PROMPTS) * 2):
        got = rollout.completion_ids[row, :rollout.lengths[row]].tolist()
        assert got == expected[row // 2]
    assert (rollout.sampler_logprobs == 0).all()


def test_greedy_equals_generate_with_grouped_query_attention():
    """A GQA variant of tiny (4 query heads sharing 2 kv heads): the fast decoder's grouped attention."""
    model, tokenizer = build_tiny_model(seed=5, num_key_value_heads=2)
    model.eval()
    rollout = generate(model, tokenizer, PROMPTS, sampling=SamplingConfig(greedy=True, max_new_tokens=30),
                       backend="fast")
    expected = hf_greedy(model, tokenizer, PROMPTS, 30)
    assert [rollout.completion_ids[b, :rollout.lengths[b]].tolist() for b in range(3)] == expected


def test_group_layout_and_prompt_padding(tiny):
    model, tokenizer = tiny
    G = 3
    rollout = generate(model, tokenizer, PROMPTS, group_size=G, sampling=SamplingConfig(max_new_tokens=8))
    N = len(PROMPTS) * G
    assert rollout.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert rollout.completion_ids.shape[0] == rollout.mask.shape[0] == len(rollout.texts) == N
    for row in range(N):
        prompt = PROMPTS[row // G]
        real = rollout.prompt_ids[row][rollout.prompt_attention_mask[row]].tolist()
        assert tokenizer.decode(real) == prompt
        assert not rollout.prompt_attention_mask[row, :-len(real)].any()  # left padding only
    # samples of one prompt differ from each other (different uniforms per row)
    assert not torch.equal(rollout.completion_ids[0], rollout.completion_ids[1])


def test_stop_tokens_mask_and_truncation(tiny):
    """Ten digit tokens end a completion: each step ends a row with probability ~10/101, so over 20
    steps some rows finish and some are truncated. The mask covers exactly the tokens up to and
    including the stop token; after it, padding; truncated rows are full length without a stop token."""
    model, tokenizer = tiny
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingConfig(max_new_tokens=20, stop_token_ids=digits)
    rollout = generate(model, tokenizer, PROMPTS, group_size=8, sampling=sampling, seed=1)
    stops = set(stop_token_ids(model, tokenizer, sampling))
    assert tokenizer.eos_token_id in stops and set(digits) <= stops
    assert rollout.finished.any() and rollout.truncated.any()
    assert torch.equal(rollout.finished, ~rollout.truncated)
    for row in range(rollout.mask.shape[0]):
        length = int(rollout.lengths[row])
        ids = rollout.completion_ids[row].tolist()
        assert rollout.mask[row].tolist() == [True] * length + [False] * (len(ids) - length)
        assert all(t == rollout.pad_token_id for t in ids[length:])
        assert not any(t in stops for t in ids[:length - 1])
        if rollout.finished[row]:
            assert ids[length - 1] in stops
        else:
            assert length == 20 and ids[length - 1] not in stops
        assert rollout.texts[row] == tokenizer.decode(ids[:length], skip_special_tokens=True)
    check_logprobs_against_forward(model, rollout)


def test_min_new_tokens_bans_stop_tokens_and_renormalises(tiny):
    model, tokenizer = tiny
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingConfig(max_new_tokens=12, min_new_tokens=6, stop_token_ids=digits)
    rollout = generate(model, tokenizer, PROMPTS, group_size=8, sampling=sampling, seed=1)
    assert (rollout.lengths >= 6).all() and rollout.finished.any()
    assert not any(t in digits for t in rollout.completion_ids[:, :5].flatten().tolist())
    # before min_new_tokens the sampler's distribution excludes the stop tokens, so its log-prob is
    # the plain one minus log(1 - stop mass): strictly larger
    early = rollout.mask.clone()
    early[:, 6:] = False
    assert (rollout.sampler_logprobs[early] > rollout.logprobs[early]).all()
    assert torch.allclose(rollout.sampler_logprobs[:, 6:], rollout.logprobs[:, 6:])


def test_stop_strings(tiny):
    """A completion stops at the first token that completes a stop string; its text ends there."""
    model, tokenizer = tiny
    stop_strings = ("a", "e", "o", "u", "i", "1", "xy")
    sampling = SamplingConfig(max_new_tokens=25, stop_strings=stop_strings)
    rollout = generate(model, tokenizer, PROMPTS, group_size=6, sampling=sampling, seed=2)
    eos = set(stop_token_ids(model, tokenizer, sampling))  # the model may also end a row with EOS
    assert rollout.finished.any() and rollout.truncated.any()
    for row in range(rollout.mask.shape[0]):
        length = int(rollout.lengths[row])
        ids = rollout.completion_ids[row, :length].tolist()
        before = tokenizer.decode(ids[:-1], skip_special_tokens=True)
        assert not any(s in before for s in stop_strings)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if rollout.finished[row] and ids[-1] not in eos:
            assert any(text.endswith(s) for s in stop_strings) and rollout.texts[row] == text
        elif not rollout.finished[row]:
            assert length == 25 and not any(s in text for s in stop_strings)


def test_stop_string_cut_inside_a_token():
    """With multi-character tokens, the text is cut just after the stop string."""
    from posttrain.rollout.engine import _StopStrings

    stops = _StopStrings(None, ("###", "\n\n"))
    assert stops.cut("answer: 4\n\nmore") == "answer: 4\n\n"
    assert stops.cut("x ### y \n\n") == "x ###"
    assert stops.cut("nothing") == "nothing"


def test_same_seed_same_rollout_other_seed_differs(tiny):
    model, tokenizer = tiny
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=16)
    first = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=7)
    again = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=7)
    other = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=8)
    assert torch.equal(first.completion_ids, again.completion_ids) and first.texts == again.texts
    assert torch.equal(first.sampler_logprobs, again.sampler_logprobs)
    assert not torch.equal(first.completion_ids, other.completion_ids)


@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_chunking_gives_the_same_rollout(tiny, backend):
    """One prompt per chunk (max_batch_size = G) vs all prompts in one batch: same tokens, same
    log-probs (float tolerance: padding widths differ), same flags. Stop tokens make rows finish at
    different steps, so compaction runs too."""
    model, tokenizer = tiny
    digits = tuple(tokenizer.convert_tokens_to_ids(list("0123456789")))
    sampling = SamplingConfig(temperature=0.8, top_p=0.95, max_new_tokens=20, stop_token_ids=digits)
    whole = generate(model, tokenizer, PROMPTS, group_size=4, sampling=sampling, seed=5, backend=backend)
    chunked = generate(model, tokenizer, PROMPTS, group_size=4, sampling=sampling, seed=5, backend=backend,
                       max_batch_size=4)
    assert whole.finished.any() and whole.truncated.any()
    assert torch.equal(whole.completion_ids, chunked.completion_ids)
    assert torch.equal(whole.mask, chunked.mask) and torch.equal(whole.finished, chunked.finished)
    assert torch.allclose(whole.sampler_logprobs, chunked.sampler_logprobs, atol=1e-5)
    assert whole.texts == chunked.texts


def test_token_id_prompts_equal_string_prompts(tiny):
    model, tokenizer = tiny
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    sampling = SamplingConfig(max_new_tokens=10)
    from_text = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, seed=4)
    from_ids = generate(model, tokenizer, ids, group_size=2, sampling=sampling, seed=4)
    assert torch.equal(from_text.completion_ids, from_ids.completion_ids)


def test_forward_inputs_layout(tiny):
    """[left pad][prompt][completion][right pad]; positions count real tokens from 0."""
    model, tokenizer = tiny
    rollout = generate(model, tokenizer, ["ab", "abcd"], sampling=SamplingConfig(max_new_tokens=3, greedy=True))
    inputs = rollout.forward_inputs()
    P = rollout.prompt_ids.shape[1]
    assert P == 4
    assert inputs["attention_mask"][0, :P].tolist() == [0, 0, 1, 1]
    assert inputs["position_ids"][0, 2:P + 3].tolist() == [0, 1, 2, 3, 4]
    assert inputs["position_ids"][1, :P + 3].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert torch.equal(inputs["input_ids"][:, P:], rollout.completion_ids)


def test_first_token_frequencies_match_the_model(tiny):
    """End to end chi-square: 1200 one-token samples of one prompt at temperature 0.1 with top_k 4
    against the model's own softmax(logits / 0.1) over its top 4 tokens, renormalised (about
    [0.72, 0.105, 0.097, 0.080])."""
    model, tokenizer = tiny
    sampling = SamplingConfig(temperature=0.1, top_k=4, max_new_tokens=1)
    rollout = generate(model, tokenizer, ["Hello"], group_size=1200, sampling=sampling, seed=11,
                       max_batch_size=400)
    with torch.no_grad():
        logits = model(**tokenizer("Hello", return_tensors="pt")).logits[0, -1] / 0.1
    top = torch.topk(logits, 4)
    probs = torch.softmax(top.values, -1).double()
    assert probs.min() > 0.05  # the check below has power: every kept token is reasonably likely
    tokens = rollout.completion_ids[:, 0]
    assert set(tokens.tolist()) <= set(top.indices.tolist())
    counts = torch.stack([(tokens == t).sum() for t in top.indices]).double()
    assert chi_square(counts, probs) < CHI2_999_DF3


def test_lora_adapters_are_folded_into_the_fast_decoder():
    """A PEFT LoRA policy takes the fast path with its adapters folded in: log-probs equal the PEFT
    model's own forward, with adapters on and (reference-style) disabled, and the fast and generic
    decoders sample the same tokens."""
    from posttrain.models import apply_lora
    from posttrain.rollout.llama_decoder import unsupported_reason

    model, tokenizer = build_tiny_model(seed=0)
    model = apply_lora(model)
    with torch.no_grad():  # make the adapters matter
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    model.eval()
    assert unsupported_reason(model, 64) is None
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=10)
    fast = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, backend="fast")
    check_logprobs_against_forward(model, fast)
    generic = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, backend="hf")
    assert torch.equal(fast.completion_ids, generic.completion_ids)
    with model.disable_adapter():
        plain = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, backend="fast")
        check_logprobs_against_forward(model, plain)
    assert not torch.allclose(plain.logprobs, fast.logprobs)
    again = generate(model, tokenizer, PROMPTS, group_size=2, sampling=sampling, backend="fast")
    assert torch.equal(again.completion_ids, fast.completion_ids)  # adapters back on: not the stale copy


def test_an_unknown_backend_is_one_line_naming_the_choices(tiny):
    from posttrain.errors import UserError

    model, tokenizer = tiny
    with pytest.raises(UserError, match=r"backend must be one of \('auto', 'fast', 'hf'\)"):
        generate(model, tokenizer, PROMPTS, backend="nope")


def test_rollout_tensors_are_usable_in_a_training_step(tiny):
    """No field is an inference-mode tensor (autograd would refuse to save it for backward)."""
    model, tokenizer = tiny
    rollout = generate(model, tokenizer, PROMPTS, group_size=2, sampling=SamplingConfig(max_new_tokens=6))
    for name, value in vars(rollout).items():
        if isinstance(value, torch.Tensor):
            assert not value.is_inference(), name
    weight = torch.ones((), requires_grad=True)
    (weight * rollout.logprobs * rollout.mask).sum().backward()
    assert weight.grad is not None


# --- select / concat / to: sub-rollouts and merged rollouts ---------------------------------------
def assert_same_rollout(actual: Rollout, expected: Rollout):
    """Field by field: tensors equal in value, dtype and device; everything else equal."""
    for field in dataclasses.fields(Rollout):
        got, want = getattr(actual, field.name), getattr(expected, field.name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.device == want.device, field.name
            assert got.shape == want.shape and torch.equal(got, want), field.name
        else:
            assert got == want, field.name


@pytest.fixture(scope="module")
def two_rollouts(tiny):
    """Two real rollouts (G = 2) whose prompt widths P and completion widths T differ."""
    model, tokenizer = tiny
    first = generate(model, tokenizer, PROMPTS, group_size=2, sampling=SamplingConfig(max_new_tokens=4), seed=1)
    second = generate(model, tokenizer, ["Q: what is the sum of 12 and 30, in words?\nA:", "Hi"], group_size=2,
                      sampling=SamplingConfig(temperature=0.8, max_new_tokens=9), seed=2)
    assert first.prompt_ids.shape[1] < second.prompt_ids.shape[1]
    assert first.completion_ids.shape[1] < second.completion_ids.shape[1]
    return first, second


def test_select_keeps_whole_groups_and_renumbers_them(two_rollouts):
    """Groups 2 then 0 of the first rollout: rows [4, 5, 0, 1], widths kept, prompt_index [0, 0, 1, 1]."""
    rollout, _ = two_rollouts
    rows = [4, 5, 0, 1]
    expected = Rollout(
        prompt_ids=torch.tensor([rollout.prompt_ids[r].tolist() for r in rows]),
        prompt_attention_mask=torch.tensor([rollout.prompt_attention_mask[r].tolist() for r in rows]),
        completion_ids=torch.tensor([rollout.completion_ids[r].tolist() for r in rows]),
        mask=torch.tensor([rollout.mask[r].tolist() for r in rows]),
        sampler_logprobs=torch.tensor([rollout.sampler_logprobs[r].tolist() for r in rows]),
        logprobs=torch.tensor([rollout.logprobs[r].tolist() for r in rows]),
        finished=torch.tensor([bool(rollout.finished[r]) for r in rows]),
        truncated=torch.tensor([bool(rollout.truncated[r]) for r in rows]),
        texts=[rollout.texts[r] for r in rows],
        prompt_index=torch.tensor([0, 0, 1, 1]),
        group_size=2, sampling=rollout.sampling, pad_token_id=rollout.pad_token_id,
    )
    assert_same_rollout(rollout.select(torch.tensor(rows)), expected)


def test_concat_repads_prompts_left_and_completions_right(two_rollouts):
    """Groups [2, 0] of the first rollout, none of the second, then group [1] of the second: rows
    first[4, 5, 0, 1] + second[2, 3], each prompt left-padded and each completion right-padded to
    the second's (wider) P and T, prompt_index [0, 0, 1, 1, 2, 2], settings of the first."""
    first, second = two_rollouts
    P, T, pad = second.prompt_ids.shape[1], second.completion_ids.shape[1], first.pad_token_id
    picked = [(first, 4), (first, 5), (first, 0), (first, 1), (second, 2), (second, 3)]

    def left(rollout, row, name, fill):
        values = getattr(rollout, name)[row].tolist()
        return [fill] * (P - len(values)) + values

    def right(rollout, row, name, fill):
        values = getattr(rollout, name)[row].tolist()
        return values + [fill] * (T - len(values))

    expected = Rollout(
        prompt_ids=torch.tensor([left(r, row, "prompt_ids", pad) for r, row in picked]),
        prompt_attention_mask=torch.tensor([left(r, row, "prompt_attention_mask", False) for r, row in picked]),
        completion_ids=torch.tensor([right(r, row, "completion_ids", pad) for r, row in picked]),
        mask=torch.tensor([right(r, row, "mask", False) for r, row in picked]),
        sampler_logprobs=torch.tensor([right(r, row, "sampler_logprobs", 0.0) for r, row in picked]),
        logprobs=torch.tensor([right(r, row, "logprobs", 0.0) for r, row in picked]),
        finished=torch.tensor([bool(r.finished[row]) for r, row in picked]),
        truncated=torch.tensor([bool(r.truncated[row]) for r, row in picked]),
        texts=[r.texts[row] for r, row in picked],
        prompt_index=torch.tensor([0, 0, 1, 1, 2, 2]),
        group_size=2, sampling=first.sampling, pad_token_id=pad,
    )
    merged = Rollout.concat([(first, [2, 0]), (second, []), (second, [1])])
    assert_same_rollout(merged, expected)
    # merged row 0 is first's row 4, re-padded on both sides: the same real tokens at the same positions
    inputs, original = merged.forward_inputs(), first.forward_inputs()
    real, real_original = inputs["attention_mask"][0].bool(), original["attention_mask"][4].bool()
    for name in ("input_ids", "position_ids"):
        assert inputs[name][0][real].tolist() == original[name][4][real_original].tolist(), name


def test_concat_of_one_part_with_all_groups_is_the_part(two_rollouts):
    for rollout in two_rollouts:
        assert_same_rollout(Rollout.concat([(rollout, range(len(rollout.texts) // rollout.group_size))]), rollout)


def test_to_moves_every_tensor_and_nothing_else(two_rollouts):
    rollout, _ = two_rollouts
    assert_same_rollout(rollout.to("cpu"), rollout)
    moved = rollout.to("meta")
    for field in dataclasses.fields(Rollout):
        value, original = getattr(moved, field.name), getattr(rollout, field.name)
        if isinstance(original, torch.Tensor):
            assert value.device.type == "meta", field.name
            assert (value.shape, value.dtype) == (original.shape, original.dtype), field.name
        else:
            assert value == original, field.name


def episode_like(rollout: Rollout, seen: slice) -> Rollout:
    """The rollout with the completion columns `seen` turned into a tool's output: attended, not trained."""
    attention = rollout.mask.clone()
    mask = rollout.mask.clone()
    mask[:, seen] = False
    return dataclasses.replace(rollout, mask=mask, attention=attention)


def test_attention_apart_from_the_loss_mask_is_seen_not_trained(tiny):
    """A completion whose columns 2-3 are a tool's output (attention True, loss mask False): the
    forward attends to them (a later token's logits change when they change), every row keeps its
    length, select / concat / to carry the attention mask, and the online loss's gradient at those
    positions is exactly zero."""
    from posttrain.algorithms import aggregate, clipped_surrogate, token_logprobs
    from posttrain.models.forward import completion_logits

    model, tokenizer = tiny
    rollout = generate(model, tokenizer, ["12+34=", "5+6="], group_size=2, sampling=SamplingConfig(max_new_tokens=8, min_new_tokens=8), seed=1)
    episode = episode_like(rollout, slice(2, 4))
    inputs, P, T = episode.forward_inputs(), episode.prompt_ids.shape[1], episode.completion_ids.shape[1]
    assert torch.equal(inputs["attention_mask"][:, P:].bool(), rollout.mask) and torch.equal(episode.lengths, rollout.lengths)
    changed = dataclasses.replace(episode, completion_ids=episode.completion_ids.clone())
    changed.completion_ids[:, 2] = (changed.completion_ids[:, 2] + 1) % model.config.vocab_size
    rows = torch.arange(4)
    with torch.no_grad():
        _, logits = completion_logits(model, inputs, rows, P, T, shared_prefix=False)
        _, changed_logits = completion_logits(model, changed.forward_inputs(), rows, P, T, shared_prefix=False)
    assert not torch.allclose(logits[:, 5], changed_logits[:, 5]), "the tool's output is not attended"
    assert torch.equal(episode.select(torch.tensor([2, 3])).attention, episode.attention[2:])
    assert torch.equal(Rollout.concat([(episode, [1]), (rollout, [0])]).completion_attention_mask,
                       torch.cat([episode.attention[2:], rollout.mask[:2]]))
    assert episode.to("cpu").attention is episode.attention and rollout.attention is None

    _, logits = completion_logits(model, inputs, rows, P, T, shared_prefix=False)
    logprobs = token_logprobs(logits, episode.completion_ids, 1.0)
    logprobs.retain_grad()
    per_token, _ = clipped_surrogate(logprobs, logprobs.detach(), torch.tensor([1.0, -1.0, 0.5, -0.5]), 0.2, 0.2, None)
    aggregate(per_token, episode.mask, "token_mean", episode.mask.sum(), 4, max_length=T).backward()
    assert torch.all(logprobs.grad[:, 2:4] == 0) and torch.all(logprobs.grad[episode.mask] != 0)
