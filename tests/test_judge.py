"""The LLM judge reward (`judge:MODEL`): its math by hand, its batched forward against a naive
per-row forward, its refusals, its strict reply parser, its registration and its identity."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.judge import expected_score, last_position_logits, pairwise_preference, score_probabilities
from posttrain.errors import UserError
from posttrain.models import build_tiny_model
from posttrain.rewards import RewardOptions, as_verifier, get_verifier
from posttrain.rewards.judge import DEFAULT_TEMPLATE, JudgeVerifier, conversation_text, parse_score

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4"},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "Name a colour of the sky on a clear day, and say why it is that colour."}]},
    {"prompt": "Say hi"},
]
COMPLETIONS = ["4", "Blue: air scatters short wavelengths more than long ones.", "hi"]


@pytest.fixture(scope="module")
def judge():
    return JudgeVerifier("tiny", loaded=build_tiny_model(), batch_size=2)


# --- the math ------------------------------------------------------------------------------------
def test_expected_score_of_the_issues_example():
    """p = [0.1, 0.2, 0.4, 0.2, 0.1] over "1".."5": E[k] = 0.1 + 0.4 + 1.2 + 0.8 + 0.5 = 3,
    reward = (3 - 1) / (5 - 1) = 0.5. Logits log p reproduce p; adding 7.3 to every logit changes
    nothing (the softmax's normaliser absorbs it)."""
    probabilities = torch.tensor([[0.1, 0.2, 0.4, 0.2, 0.1]])
    logits = probabilities.log()
    assert expected_score(logits).tolist() == pytest.approx([0.5], abs=1e-6)
    assert expected_score(logits + 7.3).tolist() == pytest.approx([0.5], abs=1e-6)
    assert score_probabilities(logits + 7.3).tolist()[0] == pytest.approx([0.1, 0.2, 0.4, 0.2, 0.1], abs=1e-6)


def test_expected_score_ends_of_the_scale():
    """All mass on "1": E = 1, reward 0; all on "K": E = K, reward 1; uniform over 1..4: E = 2.5,
    reward 1.5 / 3 = 0.5. A one-point scale is refused."""
    logits = torch.tensor([[30.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 30.0], [1.0, 1.0, 1.0, 1.0]])
    assert expected_score(logits).tolist() == pytest.approx([0.0, 1.0, 0.5], abs=1e-6)
    with pytest.raises(ValueError):
        expected_score(torch.zeros(1, 1))


def test_pairwise_preference_of_the_issues_example():
    """A first: the first-shown answer wins with 0.8; B first: with 0.4 (so A wins with 0.6).
    P(A > B) = 1/2 (0.8 + 1 - 0.4) = 0.7; position bias = 1/2 (0.8 + 0.4) - 1/2 = 0.1.
    An unbiased judge (p_ba = 1 - p_ab = 0.3 for p_ab = 0.7): P = 0.7, bias 0."""
    p, bias = pairwise_preference(torch.tensor([0.8, 0.7]), torch.tensor([0.4, 0.3]))
    assert p.tolist() == pytest.approx([0.7, 0.7], abs=1e-6)
    assert bias.tolist() == pytest.approx([0.1, 0.0], abs=1e-6)


def test_last_position_logits_reads_the_attention_mask():
    """T = 4, masks [0, 1, 1, 1] and [1, 1, 0, 0]: last attended positions 3 and 1. With the
    logits of the last L = 1 position only (left padding), row 0 reads its one kept position."""
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # logits[n, t] = 12n + 3t + (0, 1, 2)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    assert last_position_logits(logits, mask).tolist() == [[9.0, 10.0, 11.0], [15.0, 16.0, 17.0]]
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert last_position_logits(logits[:, -1:], left).tolist() == [[9.0, 10.0, 11.0], [21.0, 22.0, 23.0]]


def test_parse_score_is_strict():
    """The reply must start (after spaces) with an integer in 1..K that is not a decimal."""
    assert [parse_score(reply, 5) for reply in ["4", " 4.", "5\n", "1 because", "3/5"]] == [4, 4, 5, 1, 3]
    assert [parse_score(reply, 5) for reply in ["great!", "9", "0", "45", "4.5", "Score 4", ""]] == [None] * 7


# --- logit mode on the tiny model ----------------------------------------------------------------
def naive_rewards(judge: JudgeVerifier, completions, rows) -> list[float]:
    """One unpadded forward per row, the softmax over the WHOLE vocabulary at the last position,
    then the K score tokens' probabilities renormalised and E[k] rescaled."""
    rewards = []
    for completion, row in zip(completions, rows):
        ids = judge.encode(judge.render(judge.rubric(completion, row), judge.score_tokens.prompt_suffix))
        with torch.no_grad():
            logits = judge.model(input_ids=torch.tensor([ids])).logits[0, -1]
        probabilities = torch.softmax(logits.double(), -1)[list(judge.score_tokens.ids)]
        probabilities = probabilities / probabilities.sum()
        expected = sum((k + 1) * p for k, p in enumerate(probabilities.tolist()))
        rewards.append((expected - 1) / (judge.max_score - 1))
    return rewards


def test_logit_mode_matches_the_naive_forward_and_row_by_row(judge):
    """Rows of different lengths in batches of 2 (so one batch is padded) score as a naive per-row
    forward does (to 1e-5) and as each row alone does."""
    batched = judge.batch(COMPLETIONS, ROWS)
    assert [v.status for v in batched] == ["ok"] * 3
    rewards = [v.reward for v in batched]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert rewards == pytest.approx(naive_rewards(judge, COMPLETIONS, ROWS), abs=1e-5)
    alone = [judge.score(c, row).reward for c, row in zip(COMPLETIONS, ROWS)]
    assert rewards == pytest.approx(alone, abs=1e-5)
    assert sum(batched[0].details["probabilities"]) == pytest.approx(1.0, abs=1e-5)
    assert judge.batch(COMPLETIONS, ROWS)[1].reward == batched[1].reward  # deterministic


def test_rendering_rule(judge):
    """Messages become "role: content" blocks; a prompt is one user message; the gold answer is
    shown only for a row that has one; the prompt ends with the judge's chat template's generation
    prompt and the cue, and the tiny tokenizer writes "Score: 4" as the cue, a space, then "4"."""
    assert conversation_text(ROWS[1]).startswith("system: Answer briefly.\n\nuser: Name a colour")
    with_gold, without = judge.rubric("4", ROWS[0]), judge.rubric("hi", ROWS[2])
    assert "Reference answer: 4\n\n" in with_gold and "Reference answer" not in without
    text = judge.render(with_gold, judge.score_tokens.prompt_suffix)
    assert text.endswith("<|im_start|>assistant\nScore: ")
    assert judge.score_tokens.ids == tuple(judge.tokenizer.convert_tokens_to_ids(list("12345")))
    assert DEFAULT_TEMPLATE.count("{answer}") == 1


def test_a_row_with_nothing_to_judge_against_is_a_data_error(judge):
    verdicts = judge.batch(["4", "4", "4"], [{"answer": "4"}, {"prompt": "2+2?"}, {"messages": "not a list"}])
    assert [v.status for v in verdicts] == ["data_error", "ok", "data_error"]
    assert "neither a prompt nor messages" in verdicts[0].reason


# --- refusals ------------------------------------------------------------------------------------
def test_a_score_that_is_not_one_token_is_refused_in_one_line(judge):
    """K = 12: the character-level tokenizer writes "10" as "1", "0"."""
    with pytest.raises(UserError) as caught:
        JudgeVerifier("tiny", max_score=12, loaded=(judge.model, judge.tokenizer))
    message = str(caught.value)
    assert "'10'" in message and "judge:tiny" in message and "\n" not in message


def test_bad_settings_are_refused_in_one_line(judge):
    loaded = (judge.model, judge.tokenizer)
    for settings in [{"mode": "sample"}, {"max_score": 1}, {"template": "{conversation} {reply}"},
                     {"template": "Rate {completion}"}, {"template": "{conversation}\n{completion}\nScore:"}]:
        with pytest.raises(UserError) as caught:
            JudgeVerifier("tiny", loaded=loaded, **settings)
        assert "\n" not in str(caught.value)


def test_a_custom_template(judge):
    custom = JudgeVerifier("tiny", loaded=(judge.model, judge.tokenizer),
                           template="Q: {conversation}\nA: {completion}\nGold: {answer}Scale 1-{max_score}.")
    assert custom.rubric("4", ROWS[0]) == "Q: user: What is 2+2?\nA: 4\nGold: Reference answer: 4\n\nScale 1-5."
    assert custom.score("4", ROWS[0]).status == "ok"
    assert custom.describe()["template_sha256"] != judge.describe()["template_sha256"]


# --- generate mode -------------------------------------------------------------------------------
def test_generate_mode_reads_the_reply_strictly(judge, monkeypatch):
    """A reply "4" on 1..5 is (4 - 1) / 4 = 0.75; "great!" and "9" are infra_errors quoting the
    reply, never a 0."""
    generating = JudgeVerifier("tiny", mode="generate", loaded=(judge.model, judge.tokenizer))
    monkeypatch.setattr(generating, "replies", lambda prompts: ["4", "great!", "9"][:len(prompts)])
    verdicts = generating.batch(COMPLETIONS, ROWS)
    assert verdicts[0].status == "ok" and verdicts[0].reward == 0.75 and verdicts[0].details["reply"] == "4"
    assert [v.status for v in verdicts[1:]] == ["infra_error", "infra_error"]
    assert "'great!'" in verdicts[1].reason and "'9'" in verdicts[2].reason


def test_generate_mode_generates_greedily(judge):
    """A real greedy reply of the random tiny model: the same both times, scored or refused."""
    generating = JudgeVerifier("tiny", mode="generate", loaded=(judge.model, judge.tokenizer))
    first, second = generating.batch(COMPLETIONS[:2], ROWS[:2]), generating.batch(COMPLETIONS[:2], ROWS[:2])
    assert [v.to_json() for v in first] == [v.to_json() for v in second]
    assert all(v.status in ("ok", "infra_error") and "reply" in v.details for v in first)


# --- pairwise ------------------------------------------------------------------------------------
def test_prefer_combines_both_orders(judge):
    """p and position_bias follow from p_ab and p_ba as `pairwise_preference` says; a row with
    nothing to judge against gets None and a reason."""
    results = judge.prefer(ROWS[:2] + [{}], ["4", "Blue.", "x"], ["5", "Green, because of the grass.", "y"])
    for result in results[:2]:
        assert result["p"] == pytest.approx(0.5 * (result["p_ab"] + 1 - result["p_ba"]), abs=1e-6)
        assert result["position_bias"] == pytest.approx(0.5 * (result["p_ab"] + result["p_ba"]) - 0.5, abs=1e-6)
        assert 0.0 <= result["p"] <= 1.0
    assert results[2]["p"] is None and "neither" in results[2]["reason"]
    swapped = judge.prefer(ROWS[:1], ["5"], ["4"])[0]
    assert swapped["p"] == pytest.approx(1 - results[0]["p"], abs=1e-6)
    assert swapped["position_bias"] == pytest.approx(results[0]["position_bias"], abs=1e-6)


# --- registry and identity -----------------------------------------------------------------------
def test_the_registry_builds_the_judge():
    verifier = get_verifier("judge:tiny")
    assert isinstance(verifier, JudgeVerifier) and verifier.name == "judge:tiny" and not verifier.in_worker
    assert verifier.mode == "logits" and verifier.max_score == 5
    assert verifier.batch_size == 16  # reward_options.batch_size's default
    generating = get_verifier("judge:tiny,mode=generate,max_score=4,batch_size=3")
    assert (generating.mode, generating.max_score, generating.batch_size) == ("generate", 4, 3)
    assert as_verifier(None, "judge:tiny", RewardOptions(batch_size=5)).batch_size == 5
    with pytest.raises(ValueError, match="name the judge model"):
        get_verifier("judge:")
    with pytest.raises(UserError) as caught:
        as_verifier(None, "judge:")
    assert "\n" not in str(caught.value) and "judge:smollm2-135m" in str(caught.value)
    with pytest.raises(UserError):
        as_verifier(None, "judge:tiny,temperature=2")


def test_the_judges_identity_is_its_weights(judge):
    """Same seed, same weights, same hash (and computed once); one weight changed, another hash."""
    again = JudgeVerifier("tiny", loaded=build_tiny_model())
    assert judge.implementation()["judge"] == again.implementation()["judge"]
    assert "weights_hash" in judge.__dict__  # cached after the first call
    model, tokenizer = build_tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1e-3
    changed = JudgeVerifier("tiny", loaded=(model, tokenizer))
    assert changed.implementation()["judge"] != judge.implementation()["judge"]
    assert math.isfinite(changed.score("4", ROWS[0]).reward)


def test_independence_tells_judges_apart(judge):
    """Two judges with the same weights (whatever their mode) are not independent; a judge and an
    answer checker are."""
    from posttrain.evaluation.acceptance import independence

    generating = JudgeVerifier("tiny", mode="generate", loaded=(judge.model, judge.tokenizer))
    assert independence(judge, generating)[0] is False
    assert independence(judge, get_verifier("integer"))[0] is True


def test_pairs_labelled_by_a_judge_both_orders(tmp_path):
    """`posttrain pairs --labeller judge:tiny`: each prompt's distinct answers paired in order, the
    judge's preferred one chosen (p_chosen >= 1/2 + margin), both orders recorded with the position
    bias; the sidecar names the judge as the labeller; --labeller with --unpaired or a non-judge is one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    base = [sys.executable, "-m", "posttrain", "pairs", "--model", "tiny", "--data.task", "arithmetic", "--group-size", "4",
            "--data.max_prompts", "6", "--data.eval_size", "8", "--max-new-tokens", "6", "--seed", "3"]
    out = tmp_path / "judged.jsonl"
    result = subprocess.run([*base, "--labeller", "judge:tiny", "--preference-margin", "0.0", "--pairs-per-prompt", "2", "--out", str(out)],
                            capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr
    meta = json.loads((tmp_path / "judged.meta.json").read_text())
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert meta["verifier"] == "judge:tiny" and meta["labeller"].startswith("judge, pairwise") and meta["pairs"] == len(rows) > 0
    for row in rows:
        m = row["metadata"]
        p = 0.5 * (m["p_ab"] + 1 - m["p_ba"])
        assert m["p_chosen"] == pytest.approx(max(p, 1 - p), abs=1e-6) and m["p_chosen"] >= 0.5
        assert m["position_bias"] == pytest.approx(0.5 * (m["p_ab"] + m["p_ba"]) - 0.5, abs=1e-6)
        assert row["chosen"] != row["rejected"] and m["labelled_by"] == "judge:tiny"
    assert meta["position_bias_mean"] == pytest.approx(sum(r["metadata"]["position_bias"] for r in rows) / len(rows), abs=1e-6)
    for extra, message in ((["--labeller", "exact"], "give judge:MODEL"), (["--labeller", "judge:tiny", "--unpaired"], "does not apply with --unpaired")):
        refused = subprocess.run([*base, *extra, "--out", str(tmp_path / "no.jsonl")], capture_output=True, text=True, cwd=root)
        assert refused.returncode == 2 and message in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def judge_pair_settings(tmp_path, **overrides):
    from posttrain.config import build_config

    return build_config(__import__("posttrain.recipes.pairs", fromlist=["PairSettings"]).PairSettings, None, {
        "model": "tiny", "data": {"task": "arithmetic", "max_prompts": 4, "eval_size": 8}, "group_size": 4, "seed": 3,
        "sampling": {"max_new_tokens": 6, "temperature": 1.0}, "labeller": "judge:tiny", "out": str(tmp_path / "judged.jsonl"), **overrides})


def test_pairs_judge_ties_are_not_failures(tmp_path, monkeypatch):
    """A judge whose P(A > B) is within --preference-margin of 1/2 has no clear preference: a tie,
    counted apart from a pair it cannot compare (p None, its reason). Four prompts, one pair each,
    P = 0.55 (|0.05| < 0.1: tie), None ("too long"), 0.9 (A chosen), 0.2 (B chosen): 2 pairs written,
    1 tie (the clearest 0.05), 1 failure, and the summary says so naming the setting."""
    from posttrain.commands.pairs import summary_lines
    from posttrain.recipes.pairs import build_pairs

    replies = iter([0.55, None, 0.9, 0.2])

    def prefer(self, rows, answers_a, answers_b):
        out = []
        for _ in rows:
            p = next(replies)
            out.append({"p": None, "p_ab": None, "p_ba": None, "position_bias": None, "reason": "too long"} if p is None
                       else {"p": p, "p_ab": p, "p_ba": 1 - p, "position_bias": 0.0})
        return out

    monkeypatch.setattr(JudgeVerifier, "prefer", prefer)
    meta = build_pairs(judge_pair_settings(tmp_path))
    assert (meta["pairs"], meta["pairs_compared"], meta["pairs_tied"], meta["pairs_judge_failed"]) == (2, 4, 1, 1)
    assert meta["judge_failure_reasons"] == {"too long": 1} and meta["largest_tie_distance"] == pytest.approx(0.05)
    assert (meta["prompts_paired"], meta["prompts_skipped_tied"], meta["prompts_skipped_judge_failed"], meta["prompts_skipped_one_answer"]) == (2, 1, 1, 0)
    lines = summary_lines(meta)
    assert lines[0] == "2 pairs from 2 of 4 prompts, labelled by judge:tiny (skipped: 1 prompts whose pairs were ties, 1 the judge could not compare, 0 with one distinct answer)"
    assert "of 4 pairs compared, 1 ties (no clear preference: |P - 1/2| < --preference-margin 0.1), 1 the judge could not compare: too long (1)" in lines[1]


def test_pairs_judge_with_no_clear_preference_says_so(tmp_path):
    """The issue's case: the tiny judge is near indifferent, so at the default --preference-margin 0.1
    every pair is a tie. The one line says ties, names the setting and the clearest call; it does not
    say the answers "could not be scored" (nothing failed). Nothing is written."""
    from posttrain.errors import UserError
    from posttrain.recipes.pairs import build_pairs

    with pytest.raises(UserError) as refused:
        build_pairs(judge_pair_settings(tmp_path))
    message = str(refused.value)
    assert "could not be scored" not in message and "\n" not in message, message
    assert "4 were ties, no clear preference" in message and "--preference-margin 0.1" in message, message
    assert "the judge could not compare" not in message and "the clearest was" in message, message
    assert not (tmp_path / "judged.jsonl").exists()


def test_a_judge_as_held_out_checker_passes_at_its_threshold(monkeypatch):
    """`acceptance.checker: judge:MODEL`: a completion passes when the judge's reward reaches its
    pass_threshold (default 0.5, the scale's middle), not the programs' 1.0; the spec can set it."""
    from posttrain.evaluation.acceptance import evaluate_task
    from posttrain.data.examples import Example, Task
    from posttrain.models import load_model
    from posttrain.rewards import Verdict, get_verifier

    judge = get_verifier("judge:tiny,pass_threshold=0.6")
    assert judge.pass_threshold == 0.6 and judge.describe()["pass_threshold"] == 0.6
    rewards = iter([0.7, 0.55, 0.2])
    monkeypatch.setattr(type(judge), "batch", lambda self, completions, examples, workers=None: [Verdict.ok(next(rewards), "stub") for _ in completions])
    model, tokenizer = load_model("tiny")
    task = Task("t", "heldout", [Example(id=str(i), prompt=f"{i}+1=", answer=str(i + 1)) for i in range(3)], "number")
    result = evaluate_task(model, tokenizer, task, checker=judge, max_new_tokens=2, seed=0)
    assert result["correct"] == [1, 0, 0] and result["pass@1"] == pytest.approx(1 / 3)
    # pass@k counts with the same bar: two samples per problem, a pass in problems 0 and 1 (0.7, 0.61)
    rewards = iter([0.7, 0.55, 0.2] + [0.7, 0.2, 0.55, 0.61, 0.2, 0.1])
    result = evaluate_task(model, tokenizer, task, checker=judge, k=2, max_new_tokens=2, seed=0)
    assert result["pass@2"] == pytest.approx(2 / 3) and result["pass@2_n"] == 3
    with pytest.raises(Exception, match="pass_threshold"):
        get_verifier("judge:tiny,pass_threshold=2")
