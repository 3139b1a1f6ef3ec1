"""The demo's report, from one record of what it measured (`DemoResult`): summary.json, and
report.md with its plots (every stage on every held-out set, the curves, why plain DPO falls where
RPO gains, the run cards side by side, samples, and the seed's checklist for each stage and for
GRPO against DPO): the acceptance of several runs compared with their common start. Only the demo (`recipes/demo.py`) writes it today.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from posttrain.atomic import write_text_atomically  # noqa: E402
from posttrain.evaluation.acceptance import IN_DISTRIBUTION  # noqa: E402
from posttrain.evaluation.checklist import checklist, markdown  # noqa: E402
from posttrain.evaluation.run_record import read_run  # noqa: E402
from posttrain.evaluation.run_comparison import compare, comparison_markdown  # noqa: E402
from posttrain.evaluation.stats import paired_difference_ci  # noqa: E402
from posttrain.runs import read_jsonl  # noqa: E402
from posttrain.runs.plots import save_figure  # noqa: E402

LABELS = {"sft": "SFT start", "grpo": "after GRPO", "dpo": "after DPO (RPO)", "dpo_plain": "plain DPO", "grpo_rm": "GRPO on the RM"}
"""The demo's stages in report order, with their labels in the held-out figure."""
TRAINED = ("grpo", "dpo", "dpo_plain", "grpo_rm")
"""The stages trained from the SFT start, each compared with it."""
FIGURES = [
    "![held-out accuracy](plots/heldout.png)", "",
    "![GRPO reward](plots/grpo_reward.png) ![GRPO held-out](plots/grpo_heldout.png)", "",
    "![GRPO KL](plots/grpo_kl.png) ![DPO loss](plots/dpo_loss.png) ![DPO accuracy](plots/dpo_accuracy.png)", "",
    "![DPO chosen log-ratio](plots/dpo_chosen.png)", "",
    "![RM held-out pair accuracy](plots/rm_accuracy.png) ![GRPO on the RM: its reward](plots/grpo_rm_reward.png) "
    "![held-out accuracy, GRPO on the program vs on the RM](plots/grpo_rm_heldout.png)", "",
]
"""The report's figures, in the order it shows them (`_plot` draws them)."""


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo's report says: the settings it quotes and what each stage measured."""

    out: Path
    """The demo directory: the stages' runs, eval_<stage>[_<set>].json; the report goes there."""
    seed: int
    sft_steps: int
    """The SFT start's steps: the first round whose held-out pass@1 reached `sft_target` (or the most)."""
    sft_target: float
    grpo_steps: int
    """GRPO's steps, and each DPO run's, and GRPO's on the reward model."""
    rm_steps: int
    """The reward model's training steps."""
    samples_per_step: int
    """GRPO's sampled answers per step (prompts per step x group size)."""
    samples_shown: int
    """Held-out completions quoted in the report."""
    results: dict[str, dict[str, dict[str, Any]]]
    """Stage (in `LABELS` order) -> held-out set (in distribution first) -> its `evaluate_task` result."""
    run_dirs: dict[str, Path]
    """Stage -> its run directory (metrics.jsonl, run_card.json)."""
    provenance: dict[str, Any]
    """The DPO pairs' provenance (`posttrain pairs`): verifier, pairs, prompts, prompts skipped."""
    independence: tuple[bool, str]
    """Whether the `integer` checker is independent of the training reward, and why."""
    timings: dict[str, float]
    """Wall seconds of sft, grpo, pairs and dpo (both DPO runs)."""
    seconds: float
    """Wall seconds of the whole demo, up to its report."""

    def gain(self, stage: str, name: str = IN_DISTRIBUTION) -> tuple[float, float, float]:
        """`stage`'s change in pass@1 from the SFT start on set `name`, with its paired 95% interval."""
        return paired_difference_ci(self.results["sft"][name]["correct"], self.results[stage][name]["correct"])


def write_report(result: DemoResult) -> None:
    """summary.json, then report.md and its plots."""
    write_text_atomically(result.out / "summary.json", json.dumps(summary(result), indent=1) + "\n")
    rows = {stage: read_jsonl(result.run_dirs[stage] / "metrics.jsonl") for stage in (*TRAINED, "rm")}
    cards = {name: json.loads((path / "run_card.json").read_text()) for name, path in result.run_dirs.items()}
    _plot(result, rows)
    lines = (_introduction(result) + _stage_table(result, rows) + _reading(result, rows, cards["dpo_plain"].get("alarms") or [])
             + [_learned_reward(result, rows, cards), ""] + FIGURES + _links(result, cards) + _samples(result)
             + [""] + checklist_section(result.run_dirs))
    write_text_atomically(result.out / "report.md", "\n".join(lines) + "\n")


def summary(result: DemoResult) -> dict[str, Any]:
    """summary.json: in-distribution pass@1 of each stage and each gain's interval, every set's
    pass@1 per stage, the checker's independence, the demo's wall time."""
    held_out = {stage: result.results[stage][IN_DISTRIBUTION] for stage in LABELS}
    independent, why = result.independence
    return {
        "heldout_before": held_out["sft"]["pass@1"], **{f"heldout_after_{stage}": held_out[stage]["pass@1"] for stage in TRAINED},
        "n_heldout": held_out["sft"]["n"], **{f"gain_{stage}_ci95": list(result.gain(stage)[1:]) for stage in TRAINED},
        "sets": {name: {stage: result.results[stage][name]["pass@1"] for stage in LABELS} for name in result.results["sft"]},
        "checker": {"name": "integer", "independent": independent, "independence_reason": why},
        "reward_model": _reward_model(result),
        "seconds_after_install": result.seconds,
    }


def _reward_model(result: DemoResult) -> dict[str, Any]:
    """The reward model's held-out pair accuracy (with its interval) at its last step, from its run's metrics."""
    rows = [row for row in read_jsonl(result.run_dirs["rm"] / "metrics.jsonl") if row.get("heldout/preference_accuracy") is not None]
    last = rows[-1] if rows else {}
    return {"steps": result.rm_steps, "heldout_pair_accuracy": last.get("heldout/preference_accuracy"),
            "heldout_pair_accuracy_ci95": [last.get("heldout/preference_accuracy_low"), last.get("heldout/preference_accuracy_high")],
            "reward_length_correlation": last.get("heldout/reward_length_correlation")}


def _plot(result: DemoResult, rows: dict[str, list[dict]]) -> None:
    """plots/: every stage on every held-out set, and the training curves the report shows."""
    plots = result.out / "plots"
    plots.mkdir(exist_ok=True)
    _heldout_bars(plots / "heldout.png", result.results)
    curves = [
        ("grpo_reward.png", rows["grpo"], ["reward/mean"], "GRPO training reward (exact match)"),
        ("grpo_heldout.png", rows["grpo"], ["heldout/pass@1"], "GRPO held-out accuracy (in distribution)"),
        ("grpo_kl.png", rows["grpo"], ["kl/exact"], "GRPO exact KL to the SFT start"),
        ("dpo_loss.png", rows["dpo"], ["loss"], "DPO (RPO) loss"),
        ("dpo_accuracy.png", rows["dpo"], ["rewards/accuracy"], "DPO (RPO) pair accuracy (implicit reward)"),
    ]
    for name, metrics, keys, title in curves:
        _curve(plots / name, [(key, metrics) for key in keys], title)
    _curve(plots / "dpo_chosen.png", [("RPO", rows["dpo"]), ("plain DPO", rows["dpo_plain"])],
           "log pi(chosen) - log pi_ref(chosen)", key="logratio/chosen")
    _curve(plots / "rm_accuracy.png", [("heldout/preference_accuracy", rows["rm"])], "Reward model: held-out pair accuracy")
    _curve(plots / "grpo_rm_reward.png", [("reward/mean", rows["grpo_rm"])], "GRPO on the RM: training reward (the RM's, normalised)")
    _curve(plots / "grpo_rm_heldout.png", [("GRPO, program reward", rows["grpo"]), ("GRPO, reward model", rows["grpo_rm"])],
           "Held-out accuracy (in distribution, integer checker)", key="heldout/pass@1")


def _heldout_bars(path: Path, results: dict[str, dict[str, dict[str, Any]]]) -> None:
    """One group of bars per stage, one bar per held-out set, each with its 95% Wilson interval."""
    names = list(results["sft"])
    figure, axis = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        stages = [results[stage][name] for stage in LABELS]
        values = [r["pass@1"] for r in stages]
        errors = [[v - r["pass@1_ci95"][0] for v, r in zip(values, stages)], [r["pass@1_ci95"][1] - v for v, r in zip(values, stages)]]
        axis.bar([i + index * width for i in range(len(LABELS))], values, width, yerr=errors, capsize=3, label=name)
    axis.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(LABELS))], list(LABELS.values()))
    axis.set_ylabel("held-out pass@1")
    axis.set_ylim(0, 1)
    axis.set_title("Held-out accuracy per set, 95% Wilson intervals")
    axis.legend(fontsize=8)
    save_figure(figure, path)


def _curve(path: Path, series: list[tuple[str, list[dict]]], title: str, key: str | None = None) -> None:
    """One figure of `key` (or each series' label as its key) against step, one line per series."""
    figure, axis = plt.subplots(figsize=(5.5, 3.2))
    drawn = False
    for label, rows in series:
        points = [(r["step"], r[key or label]) for r in rows if r.get(key or label) is not None]
        if points:
            axis.plot(*zip(*points), marker="o" if len(points) < 25 else None, label=label if key else None)
            drawn = True
    if drawn:
        axis.set_xlabel("step")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if key:
            axis.legend(fontsize=8)
        save_figure(figure, path)
    else:
        plt.close(figure)


def _introduction(result: DemoResult) -> list[str]:
    """The title and what was measured: the sets, the checker and its independence, seed, time."""
    names = list(result.results["sft"])
    independent, why = result.independence
    return [
        "# posttrain demo: what each link changed", "",
        f"Tiny character-level Llama (3.2M parameters) on 2-digit addition. Held-out sets, never trained on: "
        f"`in_distribution` ({result.results['sft'][IN_DISTRIBUTION]['n']} sums like the training ones) and the shifted "
        + ", ".join(f"`{name}`" for name in names[1:]) + " (one more digit; the same sums asked in words; the same sums asked as a question, `What is a+b?`). "
        f"Checker: `integer` (the `<answer>` element read by an HTML parser, `int()` of its text); independent of the "
        f"`{result.provenance['verifier']}` training reward and labeller: {str(independent).lower()} ({why}). "
        f"One seed ({result.seed}); {result.seconds:.0f} s in all on this machine. The SFT start is the first "
        f"round of SFT whose held-out pass@1 reached {result.sft_target:g} (step {result.sft_steps}, or the last round): "
        "partial competence, chosen on the same held-out split, so its own score is if anything flattered and the gains understated.", "",
    ]


def _stage_table(result: DemoResult, rows: dict[str, list[dict]]) -> list[str]:
    """One row per stage: pass@1 [95% CI] on every set, its training signal, length and wall time."""
    names, timings, pairs = list(result.results["sft"]), result.timings, result.provenance["pairs"]
    model = _reward_model(result)
    titles = {"sft": f"SFT start ({result.sft_steps} steps)",
              "grpo": f"GRPO ({result.grpo_steps} steps x {result.samples_per_step} samples)",
              "dpo": f"DPO with RPO's NLL term ({result.grpo_steps} steps on {pairs} pairs)",
              "dpo_plain": "plain DPO (the same, without the NLL term)",
              "grpo_rm": f"GRPO on a reward model trained {result.rm_steps} steps on the same pairs (held-out pair accuracy "
                         f"{_accuracy_text(model)})"}
    signals = {"sft": "n/a", "grpo": f"{_last(rows['grpo'], 'reward/mean')} (reward)",
               "dpo": f"{_last(rows['dpo'], 'rewards/accuracy')} (pair accuracy)",
               "dpo_plain": f"{_last(rows['dpo_plain'], 'rewards/accuracy')} (pair accuracy)",
               "grpo_rm": f"{_last(rows['grpo_rm'], 'reward/mean')} (RM reward, normalised)"}
    walls = {"sft": f"{timings['sft']:.0f} s", "grpo": f"{timings['grpo']:.0f} s",
             "dpo": f"{timings['pairs'] + timings['dpo']:.0f} s (pairs {timings['pairs']:.0f} s, both DPO runs)", "dpo_plain": "(above)",
             "grpo_rm": f"{timings['rm'] + timings['grpo_rm']:.0f} s (RM {timings['rm']:.0f} s)"}
    lines = ["| stage | " + " | ".join(f"{name} [95% CI]" for name in names) + " | training signal (last step) | mean length | wall time |",
             "|---|" + "---|" * (len(names) + 3)]
    for stage in LABELS:
        sets = result.results[stage]
        lines.append(f"| {titles[stage]} | " + " | ".join(_cell(sets[name]) for name in names)
                     + f" | {signals[stage]} | {sets[IN_DISTRIBUTION]['mean_length']:.1f} | {walls[stage]} |")
    return lines


def _reading(result: DemoResult, rows: dict[str, list[dict]], alarms: list[str]) -> list[str]:
    """The in-distribution gains, how to read them with the shifted sets, and why plain DPO falls."""
    grpo, rpo, plain = (result.gain(stage) for stage in ("grpo", "dpo", "dpo_plain"))
    return [
        "",
        f"Gains over the start on `in_distribution` (paired over the same problems): GRPO {grpo[0]:+.3f} [{grpo[1]:+.3f}, {grpo[2]:+.3f}]; "
        f"DPO with the NLL term {rpo[0]:+.3f} [{rpo[1]:+.3f}, {rpo[2]:+.3f}]; "
        f"plain DPO {plain[0]:+.3f} [{plain[1]:+.3f}, {plain[2]:+.3f}].", "",
        "How to read it: the interval is what matters; a gain whose interval excludes 0 is unlikely to be noise. "
        "Training reward is what the optimizer saw; held-out accuracy, from problems it never saw, is the acceptance; "
        "the shifted sets say whether what was learned carries beyond the training distribution. "
        + _shift_reading(result), "",
        _two_dpo_runs(result, rows["dpo"], rows["dpo_plain"], alarms), "",
    ]


def _shift_reading(result: DemoResult) -> str:
    """One sentence per shifted set: each stage's change from the SFT start with its paired 95%
    interval (same problems), and whether any stage moved it at all."""
    sentences, labels = [], {"grpo": "GRPO", "dpo": "RPO", "dpo_plain": "plain DPO", "grpo_rm": "GRPO on the RM"}
    stages = result.results
    for name in stages["sft"]:
        if name == IN_DISTRIBUTION:
            continue
        start = stages["sft"][name]
        if all(stages[stage][name]["correct"] == start["correct"] for stage in labels):
            sentences.append(f"No stage moved `{name}` (all at {start['pass@1']:.3f}): what the stages taught does not carry to it; "
                             "a character-level model trained on 2-digit sums learned that format, not addition.")
            continue
        changes = []
        for stage, label in labels.items():
            gain, low, high = result.gain(stage, name)
            verdict = "a gain" if low > 0 else "a loss" if high < 0 else "no clear change"
            changes.append(f"{label} {stages[stage][name]['pass@1']:.3f} ({gain:+.3f} [{low:+.3f}, {high:+.3f}], {verdict})")
        sentences.append(f"`{name}` from {start['pass@1']:.3f} at the SFT start: " + "; ".join(changes) + ".")
    return " ".join(sentences)


def _change(result: DemoResult, stage: str) -> str:
    """'rose'/'fell'/'did not clearly change' for `stage` on the in-distribution set, by its paired interval."""
    gain, low, high = result.gain(stage)
    verdict = "rose" if low > 0 else "fell" if high < 0 else "did not clearly change"
    return f"{verdict} ({gain:+.3f} [{low:+.3f}, {high:+.3f}])"


def _two_dpo_runs(result: DemoResult, rpo_rows: list[dict], plain_rows: list[dict], alarms: list[str]) -> str:
    """The two DPO runs read side by side: likelihood displacement from their chosen log-ratios and
    plain DPO's alarm, and what each did to held-out accuracy (by its interval, never assumed)."""
    plain_low, plain_step = _lowest(plain_rows, "logratio/chosen")
    rpo_low, rpo_step = _lowest(rpo_rows, "logratio/chosen")
    plain_falls = result.gain("dpo_plain")[2] < 0
    return (
        ("**Why plain DPO falls here.** " if plain_falls else "**Plain DPO beside RPO.** ")
        + "Both DPO runs see the same pairs, steps and learning rate; the only difference is "
        "RPO's NLL term on the chosen answers. DPO's loss only asks the chosen answer's log-ratio to beat the rejected one's; "
        "it can win by pushing both down. Plain DPO's chosen log-ratio log pi(chosen) - log pi_ref(chosen) fell to "
        f"{plain_low:.2f} nats (step {plain_step}) and ended at {_last(plain_rows, 'logratio/chosen')}, while its pair accuracy ended at "
        f"{_last(plain_rows, 'rewards/accuracy')}; its held-out accuracy {_change(result, 'dpo_plain')}. "
        + (f"The likelihood-displacement alarm rang: \"{alarms[0]}\". " if alarms else "The likelihood-displacement alarm did not reach its threshold. ")
        + f"With the NLL term the chosen log-ratio stayed at or above {rpo_low:.2f} (step {rpo_step}; it ended at "
        f"{_last(rpo_rows, 'logratio/chosen')}), and held-out accuracy {_change(result, 'dpo')}."
    )


def _accuracy_text(model: dict[str, Any]) -> str:
    accuracy, (low, high) = model["heldout_pair_accuracy"], model["heldout_pair_accuracy_ci95"]
    return "n/a" if accuracy is None else f"{accuracy:.3f} [{low:.3f}, {high:.3f}]"


def _learned_reward(result: DemoResult, rows: dict[str, list[dict]], cards: dict[str, dict[str, Any]]) -> str:
    """GRPO on the reward model beside GRPO on the program, read from the runs' own figures: the
    RM's held-out pair accuracy, its reward's course, held-out accuracy, and the divergence alarm."""
    model, alarms = _reward_model(result), cards["grpo_rm"].get("alarms") or []
    reward = [row["reward/mean"] for row in rows["grpo_rm"] if row.get("reward/mean") is not None]
    divergence = [alarm for alarm in alarms if alarm.startswith("divergence")]
    threshold = cards["grpo_rm"]["links"]["acceptance"].get("divergence_alarm_threshold", "n/a")
    program, learned = result.gain("grpo"), result.gain("grpo_rm")
    apart = learned[2] < program[1]  # the RM run's interval lies wholly below the program run's
    return (
        "**Only the reward link changed: GRPO on a learned reward model.** The reward model was trained "
        f"{result.rm_steps} steps (Bradley-Terry) from the SFT start on the same {result.provenance['pairs']} pairs DPO used, "
        f"{cards['rm']['links']['acceptance']['heldout_pairs']} of them held out by prompt: held-out pair accuracy {_accuracy_text(model)}, reward-length correlation "
        f"{model['reward_length_correlation'] if model['reward_length_correlation'] is None else format(model['reward_length_correlation'], '+.3f')}. "
        f"GRPO then ran from the same start with the same settings, rewarded by that model (`rm:`, normalised by its stored scale) "
        f"instead of the program: its training reward went from {reward[0]:+.3f} to {reward[-1]:+.3f}"
        f" and its held-out accuracy {_change(result, 'grpo_rm')}, against {_change(result, 'grpo')} for GRPO on the program. "
        + (f"The divergence alarm ({threshold}) rang: \"{divergence[0]}\". " if divergence
           else f"The divergence alarm ({threshold}) did not ring. ")
        + ("The learned reward and the real goal came apart: GRPO on the reward model gained less on problems never trained on, "
           "by the integer checker, than GRPO on the program did from the same start (the two paired intervals do not overlap); "
           f"what the policy optimised is what a model with {_accuracy_text(model)} held-out pair accuracy prefers."
           if apart else
           "Here the learned reward and the real goal did not measurably come apart: the two runs' held-out intervals overlap "
           "(one seed, one task; a reward model is only as good as its held-out pair accuracy says).")
    ) if reward else "**GRPO on a learned reward model**: no training reward was logged."


def _links(result: DemoResult, cards: dict[str, dict[str, Any]]) -> list[str]:
    """The four links of SFT, GRPO and DPO side by side, where the pairs came from, the run cards."""
    provenance = result.provenance
    lines = ["## The four links, side by side", "", "| link | SFT | GRPO | DPO (RPO) | GRPO on the RM |", "|---|---|---|---|---|"]
    for link in ("data", "reward", "loss", "acceptance"):
        row = [summarise(cards[name]["links"][link]) for name in ("sft", "grpo", "dpo", "grpo_rm")]
        lines.append(f"| {link} | " + " | ".join(row) + " |")
    return lines + [
        "", f"The DPO pairs: {provenance['pairs']} (correct, incorrect) pairs from {provenance['prompts']} prompts, "
        f"labelled by verifier `{provenance['verifier']}` on samples of the SFT model; "
        f"{provenance['prompts_skipped_all_correct']} prompts skipped as all-correct, "
        f"{provenance['prompts_skipped_all_incorrect']} as all-incorrect.", "",
        "Full run cards: [SFT](sft/run_card.md), [GRPO](grpo/run_card.md), [DPO](dpo/run_card.md), [plain DPO](dpo_plain/run_card.md), "
        "[the reward model](rm/run_card.md), [GRPO on the RM](grpo_rm/run_card.md).", "",
    ]


def _samples(result: DemoResult) -> list[str]:
    """The first `samples_shown` held-out problems with every stage's completion and its verdict."""
    lines = ["## Sample held-out completions", "", "| problem | " + " | ".join(LABELS.values()) + " |", "|---|" + "---|" * len(LABELS)]
    rows = [json.loads((result.out / f"eval_{stage}.json").read_text())["rows"] for stage in LABELS]
    for index in range(min(result.samples_shown, len(rows[0]))):
        problem = rows[0][index]["prompt"].split("user\n")[-1].split("<|im_end|>")[0]
        cells = [f"`{r[index]['completion']}` ({r[index]['reason']})" for r in rows]
        lines.append(f"| `{problem}` | " + " | ".join(cells) + " |")
    return lines


STAGE_TITLES = {"sft": "SFT start", "grpo": "GRPO", "dpo": "DPO (RPO)", "dpo_plain": "plain DPO", "rm": "the reward model",
                "grpo_rm": "GRPO on the reward model"}
"""Each stage's heading in the checklist section, in the order it is shown."""


def checklist_section(run_dirs: dict[str, Path]) -> list[str]:
    """The report's last section: the seed's checklist (`evaluation/checklist.py`) answered for
    each stage's run, then GRPO against DPO (RPO) (`evaluation/run_comparison.py`): their links side
    by side, the same held-out problems and checker, the paired difference of their gains, and what
    it can be attributed to."""
    runs = {stage: read_run(run_dirs[stage]) for stage in STAGE_TITLES if stage in run_dirs}
    lines = ["## The checklist before any conclusion", "",
             "Each question answered from the stage's own run directory: yes, no, or not measured (with the command that "
             "measures it). `posttrain checklist RUN_DIR ...` prints the same; docs/checklist.md says what each answer reads.", ""]
    for stage, run in runs.items():
        lines += [f"### {STAGE_TITLES[stage]} (`{run.path.name}`)", ""] + markdown(checklist(run))
    if "grpo" in runs and "dpo" in runs:
        lines += ["### GRPO against DPO (RPO)", ""] + comparison_markdown(compare(runs["grpo"], runs["dpo"]))
    return lines


def _cell(result: dict[str, Any]) -> str:
    """pass@1 [95% interval] of one stage on one set."""
    low, high = result["pass@1_ci95"]
    return f"{result['pass@1']:.3f} [{low:.3f}, {high:.3f}]"


def _last(rows: list[dict], key: str) -> str:
    """The last logged value of `key`, to 3 decimals ('n/a' if never logged)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{values[-1]:.3f}" if values else "n/a"


def _lowest(rows: list[dict], key: str) -> tuple[float, int]:
    """The lowest logged value of `key` and its step ((nan, 0) if never logged)."""
    values = [(r[key], r["step"]) for r in rows if r.get(key) is not None]
    return min(values) if values else (float("nan"), 0)


def summarise(link: dict[str, Any], limit: int = 6) -> str:
    """A few key settings of one link, for the side-by-side table."""
    keep = [(k, v) for k, v in link.items() if not isinstance(v, (dict, list))][:limit]
    return "<br>".join(f"{k}: {v}" for k, v in keep).replace("|", "/")
