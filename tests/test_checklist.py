"""`posttrain checklist`: the seed's questions answered from a run directory, and runs compared.

Most runs here are written by the test itself in the real formats (run_card.json, metrics.jsonl,
eval/<set>-step-N.json with per-problem scores), each built to fail one question once; one real
tiny CLI run proves the card every run ends with carries the checklist."""

import json
import math
import re
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.evaluation import checklist as cl
from posttrain.evaluation import run_comparison as rc
from posttrain.evaluation.demo_report import checklist_section
from posttrain.evaluation.run_record import read_run
from posttrain.evaluation.stats import unpaired_difference_ci, wilson_interval
from posttrain.runs import new_card, write_run_card
from posttrain.runs.results import results

EXACT = {"verifier": "exact", "extraction": "auto"}
INTEGER = {"verifier": "integer", "extraction": "auto", "implementation": {"extraction": "html.parser", "comparison": "int() equality"}}
GRPO_LOSS = {"algorithm": "GRPO (group-relative advantages, clipped surrogate, no critic)", "advantage": "group",
             "group": {"scale": "group"}, "aggregation": "token_mean"}
ONLINE_DATA = {"source": "online: the policy's own samples", "task": "arithmetic", "options": {"digits": 2}, "train_prompts": 180,
               "heldout_prompts": 20, "duplicates_removed": 3, "group_size": 4}
HALF = [1, 0] * 10  # 10 of 20 problems right
UP = [1 if i % 2 == 0 or i < 16 else 0 for i in range(20)]  # 18 of 20: HALF's 10 still right, 8 more (odd 1..15)
SIGNAL = {"steps": 10, "rows": 160, "infra_error_rate": 0.0, "data_error_rate": 0.0, "zero_variance_group_fraction": 0.25,
          "steps_without_reward_signal": 0, "steps_without_gradient": 0, "alarm": None}


def _points(correct: list) -> tuple[float, float, float]:
    scored = [c for c in correct if c is not None]
    low, high = wilson_interval(sum(scored), len(scored))
    return sum(scored) / len(scored), low, high


def write_eval(run: Path, stem: str, step: int, correct: list, checker=INTEGER, prompt="{i}+{i}=") -> None:
    """An eval file as evaluate_task writes it: summary (checker, problems, correct, ...) and rows."""
    value, low, high = _points(correct)
    rows = [{"id": f"arithmetic-eval-{i}", "prompt": prompt.format(i=i), "completion": "<answer>0</answer>", "reward": float(c or 0),
             "status": "ok", "reason": "-"} for i, c in enumerate(correct)]
    summary = {"task": "arithmetic", "checker": checker, "n": len(correct), "problems": len(correct), "pass@1": value,
               "pass@1_ci95": [low, high], "correct": correct}
    (run / "eval").mkdir(parents=True, exist_ok=True)
    (run / "eval" / f"{stem}-{step:06d}.json").write_text(json.dumps({"summary": summary, "rows": rows}))


def make_run(path: Path, *, kind="online", seed=0, sets=None, reward=EXACT, loss=GRPO_LOSS, checker=INTEGER, independent=True,
             reason="the checker integer shares no part with the training reward exact", alarms=(), signal=SIGNAL, review=None,
             data=ONLINE_DATA, lr=1e-4, prompt="{i}+{i}=", model="sft/final") -> Path:
    """A finished run of `kind` (online or dpo): evaluations at steps 0, 4, 7, 10 (the first and
    last written to eval/), each set's (start, end) per-problem scores in `sets`, and its card."""
    sets = {"in_distribution": (HALF, UP)} if sets is None else sets
    path.mkdir(parents=True)
    rows = []
    for step in range(11):
        row = {"step": step, **({"reward/mean": 0.2 + 0.05 * step, "loss": 0.1} if step and kind == "online" else {}),
               **({"logratio/chosen": -0.1, "rewards/accuracy": 0.6, "loss": 0.6} if step and kind == "dpo" else {})}
        if step in (0, 4, 7, 10):
            for name, (start, end) in sets.items():
                value, low, high = _points(start if step < 10 else end)
                row.update({f"heldout/{name}/pass@1": value, f"heldout/{name}/pass@1_low": low, f"heldout/{name}/pass@1_high": high})
                if name == "in_distribution":
                    row.update({"heldout/pass@1": value, "heldout/pass@1_low": low, "heldout/pass@1_high": high})
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    stem = "step" if kind == "online" else "task-step"
    for name, (start, end) in sets.items():
        for step, correct in ((0, start), (10, end)):
            write_eval(path, stem if name == "in_distribution" else f"{name}-step", step, correct, checker, prompt)
    card = new_card("grpo" if kind == "online" else "dpo", seed, model=model,
                    config={"seed": seed, "max_steps": 10, "optim": {"lr": lr}, "model": model})
    card["links"]["data"] = dict(data)
    card["links"]["reward"] = {**reward, "passed_as": "config name"} if kind == "online" else {
        "verifier": reward["verifier"], "verifier_settings": reward}
    card["links"]["loss"] = dict(loss)
    shifted = {name: {"task": "arithmetic", "size": 20, "checker": "integer", "training_prompts_removed": 0, "independent": independent}
               for name in sets if name != "in_distribution"}
    acceptance = {"independent": independent, "independence_reason": reason, "checker_settings": checker,
                  "sets": {"in_distribution": {"task": "arithmetic", "size": 20, "checker": "integer"}, **shifted}}
    if kind == "online":
        acceptance.update(checker_resolved=checker["verifier"], alarm_window=3, training_reward=reward,
                          divergence_alarm_threshold="absolute: a rise of 0.1 in the training reward")
        card["training_signal"] = signal
    else:
        acceptance.update(checker=checker["verifier"], displacement_threshold=5.0, alarm_window=5)
    if review is not None:
        acceptance["human_review"] = review
    card["links"]["acceptance"] = acceptance
    card["alarms"] = list(alarms)
    card["results"] = results(path)  # the end record a finished run's card holds
    write_run_card(path, card)
    return path


def answers(path: Path) -> dict[str, cl.Answer]:
    return cl.checklist(read_run(path)).answers


def test_a_sound_run_answers_yes_with_its_own_numbers(tmp_path):
    """Start 10/20, end 18/20, every start-right problem still right: 8 differences of 1, 12 of 0.
    Gain 0.4; sample variance (8 x 0.6^2 + 12 x 0.4^2) / 19 = 4.8 / 19 = 0.252632; half-width
    1.959964 x sqrt(0.252632 / 20) = 0.220281: [0.179719, 0.620281]."""
    run = make_run(tmp_path / "run")
    found = cl.checklist(read_run(run))
    said = {name: answer.answer for name, answer in found.answers.items()}
    assert said == {"heldout": "yes", "independent": "yes", "interval": "yes", "shifted": "not measured", "audit": "not measured",
                    "alarms": "yes", "review": "not measured", "signal": "yes", "seeds": "no"}
    gain = found.answers["interval"]
    assert gain.numbers["change"] == pytest.approx(0.4)
    assert gain.numbers["ci95"] == pytest.approx([0.179719, 0.620281], abs=1e-6)
    assert "+0.400 [+0.180, +0.620] paired over 20 problems" in gain.detail
    assert "20 held-out problems; the overlap check removed 3 training prompts" in found.answers["heldout"].detail
    assert "stayed silent over 3 observations" in found.answers["alarms"].detail
    assert f"`posttrain audit --verifier exact --record {run}`" in found.answers["audit"].detail
    assert found.answers["review"].detail.startswith(f"not done: `posttrain review {run}`")
    assert "one seed (0)" in found.answers["seeds"].detail
    assert found.verdict.startswith("Supported on this task: the held-out gain +0.400 [+0.180, +0.620]")
    assert found.verdict.endswith("not measured: shifted, audit, review; one seed is one sample.")


def test_a_checker_equal_to_the_reward_is_a_no_and_the_verdict_names_the_blind_spot(tmp_path):
    run = make_run(tmp_path / "run", checker=EXACT, independent=False,
                   reason="the checker is the training reward itself (exact, same settings)")
    found = cl.checklist(read_run(run))
    assert found.answers["independent"].answer == "no"
    assert found.answers["independent"].detail.startswith("the checker is the training reward itself (exact, same settings)")
    assert found.verdict.startswith("Not yet supported: the held-out gain is +0.400") and "the checker's blind spot" in found.verdict


def test_a_gain_whose_interval_spans_zero_is_a_no(tmp_path):
    """Two problems flip up, one down, 17 stay: differences mean 1/20 = 0.05; sample variance
    (2 x 0.95^2 + 1.05^2 + 17 x 0.05^2) / 19 = 2.95 / 19 = 0.155263; half-width 1.959964 x
    sqrt(0.155263 / 20) = 0.172690: [-0.122690, 0.222690]."""
    end = list(HALF)
    end[1], end[3], end[0] = 1, 1, 0
    run = make_run(tmp_path / "run", sets={"in_distribution": (HALF, end)})
    found = cl.checklist(read_run(run))
    gain = found.answers["interval"]
    assert gain.answer == "no" and gain.numbers["ci95"] == pytest.approx([-0.122690, 0.222690], abs=1e-6)
    assert gain.detail.startswith("no gain beyond noise: in_distribution: +0.050 [-0.123, +0.223] paired over 20 problems")
    assert found.verdict.startswith("Not supported: the held-out change is within noise, +0.050 [-0.123, +0.223]")


def test_a_shifted_set_that_drops_is_a_no_and_one_that_gains_carries(tmp_path):
    """words: 10/20 -> 2/20, 8 problems lost: -0.4 [-0.620281, -0.179719] (the mirror of the sound run)."""
    down = [1 if i < 4 and i % 2 == 0 else 0 for i in range(20)]
    run = make_run(tmp_path / "run", sets={"in_distribution": (HALF, UP), "words": (HALF, down), "digits_3": (HALF, UP)})
    found = cl.checklist(read_run(run))
    shifted = found.answers["shifted"]
    assert shifted.answer == "no"
    assert "words reversed: -0.400 [-0.620, -0.180] paired over 20 problems" in shifted.detail
    assert "digits_3 carried: +0.400 [+0.180, +0.620]" in shifted.detail
    assert shifted.numbers["words"]["ci95"] == pytest.approx([-0.620281, -0.179719], abs=1e-6)
    assert "the shifted held-out set words fell" in found.verdict


def test_an_alarm_that_rang_is_a_no_with_its_numbers(tmp_path):
    message = "divergence: from step 4 to 10 the training reward rose by +0.300 but held-out accuracy changed by -0.100 - the verifier may be gamed"
    run = make_run(tmp_path / "online", alarms=[message])
    alarm = answers(run)["alarms"]
    assert alarm.answer == "no" and "from step 4 to 10 the training reward rose by +0.300" in alarm.detail
    displaced = ("likelihood displacement at step 6: the chosen responses' log-prob is -6.100 nats below the reference's (threshold 5.0) "
                 "while preference accuracy rose 0.600 -> 0.700: DPO is winning by pushing both answers down")
    dpo = make_run(tmp_path / "dpo", kind="dpo", alarms=[displaced], data={"source": "offline: pairs", "removed_heldout_task_overlap": 2})
    found = cl.checklist(read_run(dpo))
    assert found.answers["alarms"].answer == "no" and "-6.100 nats below the reference's" in found.answers["alarms"].detail
    assert "the likelihood-displacement alarm rang" in found.verdict
    assert found.answers["signal"].answer == "not measured"  # an offline run scores no rows while training
    assert "the overlap check removed 2 training prompts" in found.answers["heldout"].detail
    quiet = make_run(tmp_path / "quiet", kind="dpo", data={"removed_heldout_task_overlap": 0})
    assert answers(quiet)["alarms"].detail.endswith("stayed silent over 10 observations (card: alarms)")


def test_human_review_absent_low_and_high(tmp_path):
    absent = answers(make_run(tmp_path / "absent"))["review"]
    assert absent.answer == "not measured" and "--score" in absent.detail
    low = wilson_interval(7, 10)
    disputed = answers(make_run(tmp_path / "low", review={"step": 10, "n_marked": 10, "agreement": 0.7, "ci95": list(low),
                                                          "disagreements": 3}))["review"]
    assert disputed.answer == "no" and disputed.detail.startswith(f"agreement 0.700 [{low[0]:.3f}, {low[1]:.3f}] over 10 marked rows")
    agreed = answers(make_run(tmp_path / "high", review={"step": 10, "n_marked": 20, "agreement": 1.0, "ci95": [0.839, 1.0],
                                                         "disagreements": 0}))["review"]
    assert agreed.answer == "yes"


def test_a_weak_training_signal_is_a_no(tmp_path):
    signal = {**SIGNAL, "infra_error_rate": 0.2, "zero_variance_group_fraction": 0.75}
    found = answers(make_run(tmp_path / "run", signal=signal))["signal"]
    assert found.answer == "no"
    assert "20.0% infra errors" in found.detail and "75.0% of groups without reward variance" in found.detail
    assert "more than 5% unscorable; more than 50% of groups without variance" in found.detail


def test_two_runs_differing_in_two_links_cannot_attribute_the_difference(tmp_path):
    """Both start at HALF on the same problems; b ends at UP, a at HALF: b - a in gains = 0.4 [0.180, 0.620]."""
    a = make_run(tmp_path / "a", sets={"in_distribution": (HALF, HALF)})
    b = make_run(tmp_path / "b", reward={"verifier": "math", "extraction": "boxed"},
                 loss={**GRPO_LOSS, "group": {"scale": "none"}, "aggregation": "seq_mean_token_sum_norm"})
    comparison = rc.compare(read_run(a), read_run(b))
    states = {row.link: row.state() for row in comparison.links}
    assert states["data"] == "same" and states["reward"] == "changed" and states["acceptance"] == "same"
    assert states["loss"] == "changed: aggregation: token_mean -> seq_mean_token_sum_norm; group.scale: group -> none"
    assert comparison.answers["comparable"].answer == "yes" and comparison.answers["attributable"].answer == "no"
    assert comparison.answers["attributable"].detail == "reward link and loss link differ"
    (main_set,) = comparison.sets
    assert main_set.numbers["difference"] == pytest.approx(0.4) and main_set.numbers["ci95"] == pytest.approx([0.179719, 0.620281], abs=1e-6)
    assert comparison.verdict.startswith("The reward link and loss link differ: b - a in gain (end - start) on in_distribution: "
                                         "+0.400 [+0.180, +0.620] paired over 20 problems (higher)")
    assert "cannot attribute it to one of them" in comparison.verdict
    one = rc.compare(read_run(a), read_run(make_run(tmp_path / "c", reward={"verifier": "math", "extraction": "boxed"})))
    assert one.answers["attributable"].answer == "yes" and one.verdict.startswith("Only the reward link changed: c - a")
    lr = rc.compare(read_run(a), read_run(make_run(tmp_path / "d", lr=3e-4)))
    assert lr.answers["attributable"].detail == "other settings (optim.lr: 0.0001 -> 0.0003) differ"
    assert "| in_distribution | +0.400 [+0.180, +0.620] | gain (end - start), paired over 20 problems |" in rc.comparison_markdown(comparison)
    assert "  held-out in_distribution: +0.400 [+0.180, +0.620] (gain (end - start), paired over 20 problems)\n" in rc.text([], [comparison])


def test_two_runs_on_different_heldout_sets_or_checkers_are_refused(tmp_path):
    a = make_run(tmp_path / "a")
    other_problems = make_run(tmp_path / "b", prompt="{i}*{i}=")
    refused = rc.compare(read_run(a), read_run(other_problems))
    assert refused.answers["comparable"].answer == "no" and "in_distribution: different problems (20 vs 20" in refused.answers["comparable"].detail
    assert refused.verdict.startswith("Refused: the two runs' held-out numbers cannot be compared")
    other_checker = make_run(tmp_path / "c", checker={"verifier": "exact", "extraction": "auto"})
    refused = rc.compare(read_run(a), read_run(other_checker))
    assert "in_distribution: scored by different checkers" in refused.answers["comparable"].detail
    assert {row.link: row.same for row in refused.links}["acceptance"] is False
    reason = refused.sets[0].reason  # both checkers described, no pipe in them
    assert f"| in_distribution | refused | {reason} |" in rc.comparison_markdown(refused)
    assert f"  held-out in_distribution: refused ({reason})\n" in rc.text([], [refused])


def test_seeds_of_the_same_links_are_counted_and_compared_as_noise(tmp_path):
    a, b = make_run(tmp_path / "s0", seed=0), make_run(tmp_path / "s1", seed=1)
    checklists, comparisons = rc.check_runs([a, b])
    assert [entry.answers["seeds"].answer for entry in checklists] == ["yes", "yes"]
    assert checklists[0].answers["seeds"].detail.startswith("2 seeds (0, 1)")
    assert comparisons[0].answers["attributable"].detail == "nothing differs but the seed: the difference measures run-to-run noise"
    assert comparisons[0].verdict.startswith("Nothing but the seed differs: s1 - s0 in gain (end - start) on in_distribution: +0.000")


def test_newcombe_interval_by_hand():
    """0.5 [0.4, 0.6] -> 0.7 [0.6, 0.78]: 0.2 - sqrt(0.1^2 + 0.1^2) = 0.058579, 0.2 + sqrt(0.08^2 + 0.1^2) = 0.328062."""
    value, low, high = unpaired_difference_ci(0.5, [0.4, 0.6], 0.7, [0.6, 0.78])
    assert (value, low, high) == pytest.approx((0.2, 0.2 - math.sqrt(0.02), 0.2 + math.sqrt(0.0164)))
    assert (low, high) == pytest.approx((0.058579, 0.328062), abs=1e-6)


def test_require_exits_non_zero_exactly_when_a_required_answer_is_not_yes(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert main(["checklist", str(run), "--require", "heldout,independent,interval,alarms,signal"]) == 0
    capsys.readouterr()
    assert main(["checklist", str(run), "--require", "interval,audit"]) == 1
    assert capsys.readouterr().err.strip() == f"posttrain checklist: required answers that are not yes: {run}: audit (not measured)"
    assert main(["checklist", str(run), "--require", "comparable"]) == 1  # one run: nothing compared
    capsys.readouterr()
    assert main(["checklist", str(run), "--json", "--require", "seeds"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["unmet"] == [f"{run}: seeds (no)"]
    assert [a["answer"] for a in out["runs"][0]["answers"] if a["name"] == "interval"] == ["yes"]


@pytest.mark.parametrize("argv, message", [
    (["--require", "interval,bogus"], "posttrain: error: --require: unknown question 'bogus' (known: heldout, independent"),
    (["NOTARUN"], "posttrain: error: {tmp}/NOTARUN: no such run directory"),
    (["EMPTY"], "posttrain: error: {tmp}/EMPTY: not a run directory (no run_card.json)"),
])
def test_mistakes_are_one_line(tmp_path, capsys, argv, message):
    run = make_run(tmp_path / "run")
    (tmp_path / "EMPTY").mkdir()
    argv = [str(tmp_path / arg) if arg.isupper() else arg for arg in argv]
    assert main(["checklist", *(argv if argv[0] != "--require" else [str(run), *argv])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message.format(tmp=tmp_path))


def test_the_demo_report_section_answers_each_stage_and_compares_grpo_with_dpo(tmp_path):
    """Demo-shaped stages: GRPO gains; plain DPO falls and its displacement alarm rang; GRPO vs DPO
    changed data and loss, on the same problems and checker."""
    fell = [0] * 20
    stages = {
        "grpo": make_run(tmp_path / "grpo"),
        "dpo": make_run(tmp_path / "dpo", kind="dpo", loss={"objective": "DPO sigmoid loss"}, data={"source": "offline: pairs",
                                                                                                  "removed_heldout_task_overlap": 0}),
        "dpo_plain": make_run(tmp_path / "dpo_plain", kind="dpo", sets={"in_distribution": (HALF, fell)}, data={"removed_heldout_task_overlap": 0},
                              alarms=["likelihood displacement at step 5: ..."]),
    }
    text = "\n".join(checklist_section(stages))
    assert text.startswith("## The checklist before any conclusion")
    assert "### GRPO (`grpo`)" in text and "### plain DPO (`dpo_plain`)" in text and "### GRPO against DPO (RPO)" in text
    assert "| 3 | held-out gain's 95% interval above zero | **no** | the held-out score fell: in_distribution: -0.500" in text
    assert "| 6 | divergence / displacement alarm silent | **no** | the likelihood-displacement alarm" in text
    assert "| data | online: the policy's own samples; task arithmetic {\"digits\": 2} | offline: pairs; task None | **changed** |" in text
    assert "The data link and loss link differ: dpo - grpo" in text and "cannot attribute it to one of them" in text


def test_a_real_tiny_run_ends_with_the_checklist_in_its_card(tmp_path, capsys):
    """A 2-step SFT run evaluated at steps 1 and 2: the card's checklist is the command's, every
    question answered from what the recipe wrote."""
    run = tmp_path / "sft"
    assert main(["sft", "--max-steps", "2", "--batch-size", "4", "--micro-batch-size", "2", "--data.train_size", "40",
                 "--data.eval_size", "8", "--acceptance.max_new_tokens", "4", "--acceptance.eval_every", "1",
                 "--acceptance.sets", "[]", "--output-dir", str(run)]) == 0
    card = json.loads((run / "run_card.json").read_text())
    section = {entry["name"]: entry for entry in card["checklist"]["answers"]}
    assert list(section) == list(cl.QUESTIONS)
    assert section["heldout"]["answer"] == "yes" and section["heldout"]["numbers"]["problems"] == 8
    assert section["independent"]["answer"] == "yes" and section["alarms"]["answer"] == "not measured"
    assert section["interval"]["answer"] in ("no", "yes") and "paired over 8 problems" in section["interval"]["detail"]
    assert "## Checklist" in (run / "run_card.md").read_text() and card["checklist"]["verdict"] in (run / "run_card.md").read_text()
    capsys.readouterr()
    assert main(["checklist", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["answers"] == card["checklist"]["answers"]


DEMO = Path(__file__).resolve().parent.parent / "runs" / "demo"


@pytest.mark.skipif(not (DEMO / "grpo_rm" / "run_card.json").is_file(), reason="no `make demo` output in runs/demo")
def test_the_demos_stages_get_their_expected_answers():
    """On the demo's own run directories (when `make demo` has run here): GRPO gains by an independent
    checker with no alarm; plain DPO and GRPO on the RM fall and their alarms rang; GRPO vs DPO on the
    same problems changed more than one link; GRPO on the RM vs on the program changed the reward alone."""
    checklists, comparisons = rc.check_runs([DEMO / stage for stage in ("grpo", "dpo", "dpo_plain", "grpo_rm")])
    said = {entry.run.path.name: {name: answer.answer for name, answer in entry.answers.items()} for entry in checklists}
    assert said["grpo"]["interval"] == said["dpo"]["interval"] == "yes" and said["grpo"]["independent"] == "yes"
    assert said["grpo"]["alarms"] == said["dpo"]["alarms"] == "yes"
    assert said["dpo_plain"]["interval"] == said["dpo_plain"]["alarms"] == "no"
    assert said["grpo_rm"]["interval"] == said["grpo_rm"]["alarms"] == "no"
    assert said["grpo"]["audit"] == said["grpo"]["review"] == "not measured"
    by_other = {comparison.other.path.name: comparison.answers for comparison in comparisons}
    assert by_other["dpo"]["comparable"].answer == "yes" and by_other["dpo"]["attributable"].answer == "no"
    assert by_other["grpo_rm"]["attributable"].answer == "yes" and by_other["grpo_rm"]["attributable"].detail == "only the reward link differs"


def test_an_audit_recorded_in_the_run_answers_the_audit_question(tmp_path, capsys):
    """`posttrain audit --verifier exact --record RUN` runs the real suite and leaves audit.json: yes,
    with its counts; a recorded failure is a no naming the case; --record on a non-run is one line."""
    run = make_run(tmp_path / "run")
    card = json.loads((run / "run_card.json").read_text())
    (run / "run_card.json").write_text(json.dumps({**card, "checklist": {"answers": [], "verdict": "written when the run ended"}}))
    assert main(["audit", "--verifier", "exact", "--record", str(run), "--workers", "1"]) == 0
    assert f"recorded: {run / 'audit.json'}" in capsys.readouterr().out
    record = json.loads((run / "audit.json").read_text())
    assert record["verifier"] == "exact" and record["passed"] == record["cases"] > 0 and record["failures"] == []
    audit = answers(run)["audit"]
    assert audit.answer == "yes" and f"{record['passed']} of {record['cases']} cases passed" in audit.detail
    section = json.loads((run / "run_card.json").read_text())["checklist"]  # the card's section answered again
    assert [a["answer"] for a in section["answers"] if a["name"] == "audit"] == ["yes"]
    assert "audit" in (run / "run_card.md").read_text()
    (run / "audit.json").write_text(json.dumps({**record, "passed": record["cases"] - 1, "failures": [
        {"kind": "exploit", "name": "answer in a comment", "status": "ok", "reward": 1.0, "reason": "matched"}]}))
    audit = answers(run)["audit"]
    assert audit.answer == "no" and "failed: exploit 'answer in a comment'" in audit.detail
    (run / "audit.json").write_text(json.dumps({**record, "verifier": "math"}))  # another verifier's audit does not count
    assert answers(run)["audit"].answer == "not measured"
    assert main(["audit", "--verifier", "exact", "--record", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--record {tmp_path}: not a run directory (no run_card.json)")


def test_audit_record_takes_only_the_runs_own_training_reward(tmp_path, capsys):
    """Issue 40 item 3: on a run trained with `exact`, `audit --verifier math --record RUN` is one line
    naming the run's reward and the command that records it, before any suite runs; the exact
    audit already recorded stays, and the checklist still answers yes. A run without a training
    reward (SFT) records no audit."""
    run = make_run(tmp_path / "run")
    assert main(["audit", "--verifier", "exact", "--record", str(run), "--workers", "1"]) == 0
    recorded = (run / "audit.json").read_text()
    capsys.readouterr()
    assert main(["audit", "--verifier", "math", "--record", str(run), "--workers", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"posttrain: error: --record {run}: the run was trained on the reward exact, not math; "
                                    f"record its own: posttrain audit --verifier exact --record {run}")
    assert captured.out == "", "the suite does not run"
    assert (run / "audit.json").read_text() == recorded and answers(run)["audit"].answer == "yes"
    sft = tmp_path / "sft"
    sft.mkdir()
    card = new_card("sft", 0, config={"max_steps": 1})
    card["links"]["reward"] = {"kind": "none: SFT imitates the gold answers"}
    write_run_card(sft, card)
    assert main(["audit", "--verifier", "exact", "--record", str(sft)]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--record {sft}: the sft run has no training reward to audit")
    assert not (sft / "audit.json").exists()


def killed(run: Path, last_step: int) -> Path:
    """`run` as a process killed after step `last_step` leaves it: metrics.jsonl to that step, the
    card as last written during the run (no results, no checklist: the end record)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows if row["step"] <= last_step))
    for path in (run / "eval").glob("*-000010.json"):
        path.unlink()
    card = json.loads((run / "run_card.json").read_text())
    card.pop("results")
    card["training_signal"] = {**SIGNAL, "steps": 0, "rows": 0}  # as the card was first written
    write_run_card(run, card)
    return run


def test_an_unfinished_run_says_so_first_and_answers_only_what_its_record_supports(tmp_path, capsys):
    """Issue 40 item 4 on a run directory cut as a kill after step 7 of 10 leaves it: the line before
    the answers says unfinished (last step, no end record); the gain, the silent alarm and the
    signal are "not measured (run unfinished)" with what the record shows so far, not a yes or
    "grpo scores no rows"; what the card held from the start still stands; the verdict concludes
    nothing. A run stopped before its last step (an end record, fewer steps) is unfinished too."""
    run = killed(make_run(tmp_path / "run"), 7)
    found = cl.checklist(read_run(run))
    assert found.unfinished == "unfinished: last step 7 of 10, no end record (the run died or is still running); only what its record " \
                               "supports is answered"
    said = {name: answer.answer for name, answer in found.answers.items()}
    assert said == {"heldout": "yes", "independent": "yes", "interval": "not measured", "shifted": "not measured",
                    "audit": "not measured", "alarms": "not measured", "review": "not measured", "signal": "not measured", "seeds": "no"}
    assert found.answers["interval"].detail.startswith("(run unfinished) so far: no gain beyond noise: in_distribution: +0.000")
    assert "pass@1 0.500 (step 0) -> 0.500 (step 7)" in found.answers["interval"].detail
    assert found.answers["signal"].detail == "(run unfinished) so far: the card's training_signal counts no scored row (no step recorded)"
    assert found.verdict.startswith("Nothing to conclude: the run is unfinished (last step 7 of 10, no end record)")
    assert "Supported" not in found.verdict
    capsys.readouterr()
    assert main(["checklist", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  {found.unfinished}", "said first, before the answers"
    assert "not measured  (run unfinished) so far:" in lines[4]
    rang = killed(make_run(tmp_path / "rang", alarms=["divergence alarm: reward +0.30, held-out -0.10"]), 7)
    assert answers(rang)["alarms"].answer == "no", "an alarm that already rang stands"
    assert "already: the divergence alarm rang" in cl.checklist(read_run(rang)).verdict
    stopped = make_run(tmp_path / "stopped")
    card = json.loads((stopped / "run_card.json").read_text())
    write_run_card(stopped, {**card, "run": {**card["run"], "config": {**card["run"]["config"], "max_steps": 30}}})
    (stopped / "checkpoints" / "step-000010").mkdir(parents=True)
    found = cl.checklist(read_run(stopped))
    assert found.unfinished == (f"unfinished: last step 10 of 30, stopped (it ended before its last step); `posttrain grpo --resume "
                                f"{stopped}` continues it from its last checkpoint; only what its record supports is answered")
    assert found.answers["interval"].answer == "not measured" and found.verdict.startswith("Nothing to conclude")
    assert cl.checklist(read_run(make_run(tmp_path / "done"))).unfinished is None


def test_a_run_killed_mid_way_is_unfinished_in_the_checklist(tmp_path, capsys):
    """A real grpo run of 30 steps killed (SIGKILL) after its third checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parent.parent
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    process = subprocess.Popen([sys.executable, "-m", "posttrain", "grpo", "--data.eval_size", "4", "--data.train_size", "50",
                                "--data.prompts_per_step", "2", "--data.group_size", "2", "--sampling.max_new_tokens", "6",
                                "--acceptance.eval_every", "10", "--acceptance.sets", "[]", "--reward", "callable:rewards_for_tests.digits",
                                "--checkpoint-every", "1", "--max-steps", "30", "--output-dir", str(run)],
                               env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not (run / "checkpoints" / "step-000003").exists():
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (run / "checkpoints" / "step-000003").exists()
    capsys.readouterr()
    assert main(["checklist", str(run), "--json", "--require", "signal"]) == 1
    entry = json.loads(capsys.readouterr().out)["runs"][0]
    assert re.fullmatch(r"unfinished: last step \d+ of 30, no end record \(the run died or is still running\); `posttrain grpo "
                        rf"--resume {re.escape(str(run))}` continues it from its last checkpoint; only what its record supports "
                        r"is answered", entry["unfinished"]), entry["unfinished"]
    by_name = {answer["name"]: answer for answer in entry["answers"]}
    assert by_name["signal"]["answer"] == "not measured" and "scores no rows" not in by_name["signal"]["detail"]
    assert by_name["interval"]["answer"] == "not measured" and by_name["interval"]["detail"].startswith("(run unfinished)")
    assert entry["verdict"].startswith("Nothing to conclude: the run is unfinished (last step ")


def test_sft_on_conversations_is_not_told_to_review_what_review_cannot_show(tmp_path, capsys):
    """Issue 40 item 11: SFT on a file of conversations has no held-out rows a checker scored (its
    acceptance is the held-out NLL), so `posttrain review` refuses it; the card's checklist says why
    and does not send the user there."""
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(6) for b in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "sft"
    assert main(["sft", "--data.task", str(path), "--data.eval_size", "4", "--max-steps", "2", "--batch-size", "4",
                 "--micro-batch-size", "2", "--output-dir", str(run)]) == 0
    card = json.loads((run / "run_card.json").read_text())
    review = next(answer for answer in card["checklist"]["answers"] if answer["name"] == "review")
    assert review["answer"] == "not measured" and "posttrain review " not in review["detail"] and "--score" not in review["detail"]
    assert review["detail"] == ("not done, and nothing to review: the run has no held-out rows a checker scored (eval/step-N.json, "
                                f"what `posttrain review` shows); its acceptance: token-mean NLL of the 4 held-out rows of {path}")
    assert "posttrain review " not in (run / "run_card.md").read_text()
    capsys.readouterr()
    assert main(["review", str(run)]) == 2 and "no eval results" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["checklist", "--help"], ["explain", "--help"], ["explain", "advantages", "--help"]])
def test_help_says_what_it_means_not_the_seed(argv, capsys):
    """Issue 40 item 12: users do not know what "the seed" is (the specification the project grew
    from); the help says what the thing is: the evaluation checklist, worked examples of the math."""
    with pytest.raises(SystemExit):
        main(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert "the seed" not in text and "seed's" not in text
    if argv[0] in ("--help", "checklist"):
        assert "the evaluation checklist before any conclusion" in text
