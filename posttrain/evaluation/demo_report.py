"""The demo's report, from one record of what it measured (`DemoResult`): summary.json, and
report.md with its plots (every stage on every held-out set, the curves, why plain DPO falls where
RPO gains, the run cards side by side, and samples): the acceptance of several runs compared with
their common start. Only the demo (`recipes/demo.py`) writes it today.
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
from posttrain.evaluation.stats import paired_difference_ci  # noqa: E402
from posttrain.runs import read_jsonl  # noqa: E402
from posttrain.runs.plots import save_figure  # noqa: E402

LABELS = {"sft": "SFT start", "grpo": "after GRPO", "dpo": "after DPO (RPO)", "dpo_plain": "plain DPO"}
"""The demo's stages in report order, with their labels in the held-out figure."""
TRAINED = ("grpo", "dpo", "dpo_plain")
"""The stages trained from the SFT start, each compared with it."""
FIGURES = [
    "![held-out accuracy](plots/heldout.png)", "",
    "![GRPO reward](plots/grpo_reward.png) ![GRPO held-out](plots/grpo_heldout.png)", "",
    "![GRPO KL](plots/grpo_kl.png) ![DPO loss](plots/dpo_loss.png) ![DPO accuracy](plots/dpo_accuracy.png)", "",
    "![DPO chosen log-ratio](plots/dpo_chosen.png)", "",
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
    """GRPO's steps, and each DPO run's."""
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
    rows = {stage: read_jsonl(result.run_dirs[stage] / "metrics.jsonl") for stage in TRAINED}
    cards = {name: json.loads((path / "run_card.json").read_text()) for name, path in result.run_dirs.items()}
    _plot(result, rows)
    lines = (_introduction(result) + _stage_table(result, rows) + _reading(result, rows, cards["dpo_plain"].get("alarms") or [])
             + FIGURES + _links(result, cards) + _samples(result))
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
        "seconds_after_install": result.seconds,
    }


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
    titles = {"sft": f"SFT start ({result.sft_steps} steps)",
              "grpo": f"GRPO ({result.grpo_steps} steps x {result.samples_per_step} samples)",
              "dpo": f"DPO with RPO's NLL term ({result.grpo_steps} steps on {pairs} pairs)",
              "dpo_plain": "plain DPO (the same, without the NLL term)"}
    signals = {"sft": "n/a", "grpo": f"{_last(rows['grpo'], 'reward/mean')} (reward)",
               "dpo": f"{_last(rows['dpo'], 'rewards/accuracy')} (pair accuracy)",
               "dpo_plain": f"{_last(rows['dpo_plain'], 'rewards/accuracy')} (pair accuracy)"}
    walls = {"sft": f"{timings['sft']:.0f} s", "grpo": f"{timings['grpo']:.0f} s",
             "dpo": f"{timings['pairs'] + timings['dpo']:.0f} s (pairs {timings['pairs']:.0f} s, both DPO runs)", "dpo_plain": "(above)"}
    lines = ["| stage | " + " | ".join(f"{name} [95% CI]" for name in names) + " | training signal (last step) | mean length | wall time |",
             "|---|" + "---|" * (len(names) + 3)]
    for stage in LABELS:
        sets = result.results[stage]
        lines.append(f"| {titles[stage]} | " + " | ".join(_cell(sets[name]) for name in names)
                     + f" | {signals[stage]} | {sets[IN_DISTRIBUTION]['mean_length']:.1f} | {walls[stage]} |")
    return lines


def _reading(result: DemoResult, rows: dict[str, list[dict]], alarms: list[str]) -> list[str]:
    """The in-distribution gains, how to read them with the shifted sets, and why plain DPO falls."""
    grpo, rpo, plain = (result.gain(stage) for stage in TRAINED)
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
    sentences, labels = [], {"grpo": "GRPO", "dpo": "RPO", "dpo_plain": "plain DPO"}
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


def _links(result: DemoResult, cards: dict[str, dict[str, Any]]) -> list[str]:
    """The four links of SFT, GRPO and DPO side by side, where the pairs came from, the run cards."""
    provenance = result.provenance
    lines = ["## The four links, side by side", "", "| link | SFT | GRPO | DPO (RPO) |", "|---|---|---|---|"]
    for link in ("data", "reward", "loss", "acceptance"):
        row = [summarise(cards[name]["links"][link]) for name in ("sft", "grpo", "dpo")]
        lines.append(f"| {link} | " + " | ".join(row) + " |")
    return lines + [
        "", f"The DPO pairs: {provenance['pairs']} (correct, incorrect) pairs from {provenance['prompts']} prompts, "
        f"labelled by verifier `{provenance['verifier']}` on samples of the SFT model; "
        f"{provenance['prompts_skipped_all_correct']} prompts skipped as all-correct, "
        f"{provenance['prompts_skipped_all_incorrect']} as all-incorrect.", "",
        "Full run cards: [SFT](sft/run_card.md), [GRPO](grpo/run_card.md), [DPO](dpo/run_card.md), [plain DPO](dpo_plain/run_card.md).", "",
    ]


def _samples(result: DemoResult) -> list[str]:
    """The first `samples_shown` held-out problems with every stage's completion and its verdict."""
    lines = ["## Sample held-out completions", "", "| problem | SFT start | after GRPO | after DPO (RPO) | plain DPO |", "|---|---|---|---|---|"]
    rows = [json.loads((result.out / f"eval_{stage}.json").read_text())["rows"] for stage in LABELS]
    for index in range(min(result.samples_shown, len(rows[0]))):
        problem = rows[0][index]["prompt"].split("user\n")[-1].split("<|im_end|>")[0]
        cells = [f"`{r[index]['completion']}` ({r[index]['reason']})" for r in rows]
        lines.append(f"| `{problem}` | " + " | ".join(cells) + " |")
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
