"""`posttrain demo` (what `make demo` runs): the whole product on the built-in tiny model, for real.

1. SFT trains the tiny model from scratch on 2-digit addition, just to partial competence.
2. Baseline acceptance: held-out accuracy with the independent checker.
3. GRPO from that start, rewarded by a program (RLVR).
4. `pairs` from the SFT model (verifier-labelled) and DPO on them, from the same start, with a
   comparable budget (as many sampled answers as GRPO generated): RPO (DPO plus the chosen answers'
   NLL), and plain DPO beside it, whose fall the report explains (likelihood displacement).
5. Acceptance again for each, on the same held-out sets (in distribution, one more digit, the sums
   in words, asked as a question; paired confidence intervals), with the `integer` checker written apart from the
   `exact` reward.
6. A report (`report.md`, `summary.json`, plots) next to the stages' run directories.

Each training stage is a preset (presets/tiny-sft.yaml, tiny-grpo.yaml, tiny-dpo.yaml) plus the few
overrides written below: the demo's numbers are the presets' numbers.

The seed's point, made concrete: GRPO and DPO changed different links (online vs offline data, the
same program as reward), and only held-out problems with a separate checker say what improved.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import torch  # noqa: E402

from posttrain.config import build_config  # noqa: E402
from posttrain.errors import UserError  # noqa: E402
from posttrain.data.examples import Task  # noqa: E402
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, default_shifts, evaluate_task, heldout_split, independence, shifted_sets  # noqa: E402
from posttrain.evaluation.stats import paired_difference_ci  # noqa: E402
from posttrain.models import load_model  # noqa: E402
from posttrain.rewards import get_verifier  # noqa: E402
from posttrain.runs import read_jsonl  # noqa: E402

logger = logging.getLogger(__name__)


PRESETS = Path(__file__).resolve().parents[2] / "presets"
"""The repository's presets: each demo stage is one of them plus the overrides below."""

DPO_STAGE = {"batch_size": 16, "micro_batch_size": 16, "data": {"heldout_pairs": 0}}
"""The demo's DPO stage is tiny-dpo.yaml, RPO (DPO plus the chosen answers' NLL, arXiv:2404.19733),
on every pair with as many steps as GRPO: "same reward link, different data link"."""
PLAIN_DPO = {"loss": {"nll_weight": 0.0}}
"""The comparison the report explains: the same stage without the NLL term (plain DPO)."""


@dataclass
class Config:
    output_dir: str = "runs/demo"
    """Where the stages and the report go (replaced if it holds an earlier demo)."""
    seed: int = 0
    """One seed for every stage."""
    eval_size: int = 500
    """Held-out problems, never trained on, scored by the `integer` checker (written apart from the
    `exact` training reward and labeller: posttrain/rewards/checkers.py)."""
    sft_steps: int = 600
    """SFT steps (presets/tiny-sft.yaml): enough for partial competence (some groups right, some wrong)."""
    grpo_steps: int = 50
    """GRPO steps (presets/tiny-grpo.yaml), and DPO steps."""
    samples_shown: int = 6
    """Completions quoted in the report."""
    threads: int = 1
    """torch intra-op threads. 1 for the tiny model: two OpenMP threads per process slow a tiny
    forward many times over as soon as anything else (a verifier worker, another job) wants a core."""
    sft_run: str | None = None
    """Reuse this finished SFT run directory (its step-<sft_steps> checkpoint) instead of training one."""
    max_steps: int | None = None
    """Unused (the stages have their own step counts); accepted for the common flags."""


def preset(name: str) -> Path:
    """presets/<name>.yaml of the repository (the demo runs from a clone)."""
    path = PRESETS / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"{path}: the demo's preset is missing (run the demo from a clone of the repository)")
    return path


def run(config: Config, resume: bool = False, resume_changed_config: bool = False) -> Path:
    """Run every stage; returns the demo directory (with report.md and summary.json). It always
    starts over: `resume` (and so `resume_changed_config`) is refused."""
    from posttrain.recipes import dpo, dpo_config, online, online_config, pairs, sft

    if resume or resume_changed_config:
        raise UserError("the demo always starts over; run it again without --resume")
    started = time.perf_counter()
    torch.set_num_threads(config.threads)
    out = Path(config.output_dir)
    if out.exists():
        if not (out / "summary.json").exists() and any(out.iterdir()):
            raise UserError(f"{out}: holds something other than a finished demo; choose another --output-dir")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    seed, timings = config.seed, {}

    # 1. SFT from scratch to partial competence (evaluated once, at the end).
    clock = time.perf_counter()
    sft_config = build_config(sft.Config, preset("tiny-sft"), {
        "seed": seed, "output_dir": str(out / "sft"), "data": {"eval_size": config.eval_size}, "max_steps": config.sft_steps,
        "checkpoint_every": config.sft_steps, "acceptance": {"eval_every": 0, "sets": []},  # every stage's sets are evaluated below, once
    })
    sft_dir = Path(config.sft_run) if config.sft_run else sft.run(sft_config)
    start_model = str(sft_dir / "checkpoints" / f"step-{config.sft_steps:06d}" / "model")
    if not Path(start_model).is_dir():
        raise UserError(f"{start_model}: no SFT checkpoint at step {config.sft_steps}")
    timings["sft"] = time.perf_counter() - clock
    task, options, budget = sft_config.data.task, sft_config.data.task_options, sft_config.acceptance.max_new_tokens

    # 2. Baseline acceptance on the held-out sets every stage shares: the in-distribution split and
    # the shifted ones (the task's defaults: one more digit, the sums in words; and the sums asked as
    # a question, a shift the tiny model partly manages), all scored by the independent checker.
    held_out = heldout_split(task, config.eval_size, seed, options)
    shifts = default_shifts(task, options) + [{"name": "question", "task": task, "task_options": {**options, "phrasing": "question"}}]
    sets = {IN_DISTRIBUTION: held_out, **{held.name: held.task for held in shifted_sets(
        shifts, Task("demo", "train", [], held_out.reward_kind), task, options, seed, config.eval_size)}}
    before = acceptance(start_model, sets, budget, seed, out, "sft")

    # 3. GRPO with the programmatic verifier: presets/tiny-grpo.yaml from the SFT start.
    clock = time.perf_counter()
    grpo_config = build_config(online_config.grpo_config, preset("tiny-grpo"), {
        "seed": seed, "model": start_model, "output_dir": str(out / "grpo"), "max_steps": config.grpo_steps,
        "checkpoint_every": config.grpo_steps, "data": {"eval_size": config.eval_size},
        "acceptance": {"eval_every": max(1, config.grpo_steps // 4)},
    })
    grpo_dir = online.run(grpo_config)
    timings["grpo"] = time.perf_counter() - clock

    # 4. Pairs from the SFT model's own samples, as many as GRPO drew, then DPO on them.
    clock = time.perf_counter()
    pairs_file = out / "pairs.jsonl"
    data = grpo_config.data
    provenance = pairs.build_pairs(build_config(pairs.PairSettings, None, {
        "model": start_model, "out": str(pairs_file), "group_size": data.group_size, "verifier": "exact",
        "data": {"task": task, "task_options": options, "max_prompts": config.grpo_steps * data.prompts_per_step,
                 "eval_size": config.eval_size},
        "sampling": {"max_new_tokens": budget}, "seed": seed,
    }))
    timings["pairs"] = time.perf_counter() - clock
    clock = time.perf_counter()
    dpo_dirs = {}
    for name, variant in (("dpo", {}), ("dpo_plain", PLAIN_DPO)):
        dpo_dirs[name] = dpo.run(build_config(dpo_config.Config, preset("tiny-dpo"), {
            **DPO_STAGE, **variant, "seed": seed, "model": start_model, "output_dir": str(out / name), "max_steps": config.grpo_steps,
            "checkpoint_every": config.grpo_steps, "data": {**DPO_STAGE["data"], "pairs": str(pairs_file)},
            "acceptance": {"max_new_tokens": budget},
        }))
    timings["dpo"] = time.perf_counter() - clock

    # 5. Acceptance for each on the same problems.
    def final(run: Path) -> str:
        return str(run / "checkpoints" / f"step-{config.grpo_steps:06d}" / "model")

    after_grpo = acceptance(final(grpo_dir), sets, budget, seed, out, "grpo")
    after_dpo = acceptance(final(dpo_dirs["dpo"]), sets, budget, seed, out, "dpo")
    after_plain = acceptance(final(dpo_dirs["dpo_plain"]), sets, budget, seed, out, "dpo_plain")

    # 6. Report.
    gain, low, high = paired_difference_ci(before[IN_DISTRIBUTION]["correct"], after_grpo[IN_DISTRIBUTION]["correct"])
    dpo_gain = paired_difference_ci(before[IN_DISTRIBUTION]["correct"], after_dpo[IN_DISTRIBUTION]["correct"])
    plain_gain = paired_difference_ci(before[IN_DISTRIBUTION]["correct"], after_plain[IN_DISTRIBUTION]["correct"])
    independent, why = independence(get_verifier(provenance["verifier"]), _checker(None, held_out))
    stages = {"sft": before, "grpo": after_grpo, "dpo": after_dpo, "dpo_plain": after_plain}
    summary = {
        "heldout_before": before[IN_DISTRIBUTION]["pass@1"], "heldout_after_grpo": after_grpo[IN_DISTRIBUTION]["pass@1"],
        "heldout_after_dpo": after_dpo[IN_DISTRIBUTION]["pass@1"], "heldout_after_dpo_plain": after_plain[IN_DISTRIBUTION]["pass@1"],
        "n_heldout": before[IN_DISTRIBUTION]["n"], "gain_grpo_ci95": [low, high], "gain_dpo_ci95": list(dpo_gain[1:]),
        "gain_dpo_plain_ci95": list(plain_gain[1:]),
        "sets": {name: {stage: result[name]["pass@1"] for stage, result in stages.items()} for name in sets},
        "checker": {"name": "integer", "independent": independent, "independence_reason": why},
        "seconds_after_install": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_report(out, config, grpo_config, summary, stages, (gain, low, high), dpo_gain, plain_gain, provenance,
                 timings, {"sft": sft_dir, "grpo": grpo_dir, **dpo_dirs})
    return out


def _checker(name: str | None, task: Task):
    """Every held-out set's checker: `integer`, written apart from the `exact` reward and labeller."""
    return get_verifier(name or "integer")


def acceptance(model_dir: str, sets: dict[str, Task], budget: int, seed: int, out: Path, stage: str) -> dict[str, dict[str, Any]]:
    """Greedy pass@1 of one stage's model on every held-out set (eval_<stage>.json for the
    in-distribution set, eval_<stage>_<set>.json for the others)."""
    model, tokenizer = load_model(model_dir)
    return {name: evaluate_task(model, tokenizer, task, checker=_checker(None, task), max_new_tokens=budget, seed=seed,
                                output_path=out / (f"eval_{stage}.json" if name == IN_DISTRIBUTION else f"eval_{stage}_{name}.json"))
            for name, task in sets.items()}


def write_report(out: Path, config: Config, grpo_config, summary, stages, grpo_gain, dpo_gain, plain_gain, provenance, timings,
                 dirs) -> None:
    """report.md: every stage on every held-out set, the curves, why plain DPO falls where RPO gains,
    the run cards side by side, and samples."""
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    labels = {"sft": "SFT start", "grpo": "after GRPO", "dpo": "after DPO (RPO)", "dpo_plain": "plain DPO"}
    names = list(summary["sets"])
    figure, axis = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        results = [stages[stage][name] for stage in labels]
        values = [r["pass@1"] for r in results]
        errors = [[v - r["pass@1_ci95"][0] for v, r in zip(values, results)], [r["pass@1_ci95"][1] - v for v, r in zip(values, results)]]
        axis.bar([i + index * width for i in range(len(labels))], values, width, yerr=errors, capsize=3, label=name)
    axis.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(labels))], list(labels.values()))
    axis.set_ylabel("held-out pass@1")
    axis.set_ylim(0, 1)
    axis.set_title("Held-out accuracy per set, 95% Wilson intervals")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(plots / "heldout.png", dpi=100)
    plt.close(figure)
    rows_of = {name: read_jsonl(dirs[name] / "metrics.jsonl") for name in ("grpo", "dpo", "dpo_plain")}
    curves = [
        ("grpo_reward.png", rows_of["grpo"], ["reward/mean"], "GRPO training reward (exact match)"),
        ("grpo_heldout.png", rows_of["grpo"], ["heldout/pass@1"], "GRPO held-out accuracy (in distribution)"),
        ("grpo_kl.png", rows_of["grpo"], ["kl/exact"], "GRPO exact KL to the SFT start"),
        ("dpo_loss.png", rows_of["dpo"], ["loss"], "DPO (RPO) loss"),
        ("dpo_accuracy.png", rows_of["dpo"], ["rewards/accuracy"], "DPO (RPO) pair accuracy (implicit reward)"),
    ]
    for name, rows, keys, title in curves:
        _curve(plots / name, [(key, rows) for key in keys], title)
    _curve(plots / "dpo_chosen.png", [("RPO", rows_of["dpo"]), ("plain DPO", rows_of["dpo_plain"])],
           "log pi(chosen) - log pi_ref(chosen)", key="logratio/chosen")

    def last(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{values[-1]:.3f}" if values else "n/a"

    def lowest(rows, key):
        values = [(r[key], r["step"]) for r in rows if r.get(key) is not None]
        return min(values) if values else (float("nan"), 0)

    def cell(result):
        low, high = result["pass@1_ci95"]
        return f"{result['pass@1']:.3f} [{low:.3f}, {high:.3f}]"

    gain, low, high = grpo_gain
    cards = {name: json.loads((path / "run_card.json").read_text()) for name, path in dirs.items()}
    grpo_rows, dpo_rows, plain_rows = rows_of["grpo"], rows_of["dpo"], rows_of["dpo_plain"]
    checker = summary["checker"]
    walls = {"sft": f"{timings['sft']:.0f} s", "grpo": f"{timings['grpo']:.0f} s",
             "dpo": f"{timings['pairs'] + timings['dpo']:.0f} s (pairs {timings['pairs']:.0f} s, both DPO runs)", "dpo_plain": "(above)"}
    extra = {"sft": "n/a", "grpo": f"{last(grpo_rows, 'reward/mean')} (reward)", "dpo": f"{last(dpo_rows, 'rewards/accuracy')} (pair accuracy)",
             "dpo_plain": f"{last(plain_rows, 'rewards/accuracy')} (pair accuracy)"}
    lines = [
        "# posttrain demo: what each link changed", "",
        f"Tiny character-level Llama (3.2M parameters) on 2-digit addition. Held-out sets, never trained on: "
        f"`in_distribution` ({summary['n_heldout']} sums like the training ones) and the shifted "
        + ", ".join(f"`{name}`" for name in names[1:]) + " (one more digit; the same sums asked in words; the same sums asked as a question, `What is a+b?`). "
        f"Checker: `integer` (the `<answer>` element read by an HTML parser, `int()` of its text); independent of the "
        f"`{provenance['verifier']}` training reward and labeller: {str(checker['independent']).lower()} ({checker['independence_reason']}). "
        f"One seed ({config.seed}); {summary['seconds_after_install']:.0f} s in all on this machine.", "",
        "| stage | " + " | ".join(f"{name} [95% CI]" for name in names) + " | training signal (last step) | mean length | wall time |",
        "|---|" + "---|" * (len(names) + 3),
    ]
    titles = {"sft": f"SFT start ({config.sft_steps} steps)",
              "grpo": f"GRPO ({config.grpo_steps} steps x {grpo_config.data.prompts_per_step * grpo_config.data.group_size} samples)",
              "dpo": f"DPO with RPO's NLL term ({config.grpo_steps} steps on {provenance['pairs']} pairs)",
              "dpo_plain": "plain DPO (the same, without the NLL term)"}
    for stage in labels:
        lines.append(f"| {titles[stage]} | " + " | ".join(cell(stages[stage][name]) for name in names)
                     + f" | {extra[stage]} | {stages[stage][IN_DISTRIBUTION]['mean_length']:.1f} | {walls[stage]} |")
    plain_low, plain_step = lowest(plain_rows, "logratio/chosen")
    rpo_low, rpo_step = lowest(dpo_rows, "logratio/chosen")
    alarms = cards["dpo_plain"].get("alarms") or []
    lines += [
        "",
        f"Gains over the start on `in_distribution` (paired over the same problems): GRPO {gain:+.3f} [{low:+.3f}, {high:+.3f}]; "
        f"DPO with the NLL term {dpo_gain[0]:+.3f} [{dpo_gain[1]:+.3f}, {dpo_gain[2]:+.3f}]; "
        f"plain DPO {plain_gain[0]:+.3f} [{plain_gain[1]:+.3f}, {plain_gain[2]:+.3f}].", "",
        "How to read it: the interval is what matters; a gain whose interval excludes 0 is unlikely to be noise. "
        "Training reward is what the optimizer saw; held-out accuracy, from problems it never saw, is the acceptance; "
        "the shifted sets say whether what was learned carries beyond the training distribution. "
        + _shift_reading(stages), "",
        "**Why plain DPO falls here.** Both DPO runs see the same pairs, steps and learning rate; the only difference is "
        "RPO's NLL term on the chosen answers. DPO's loss only asks the chosen answer's log-ratio to beat the rejected one's; "
        "it can win by pushing both down. Plain DPO's chosen log-ratio log pi(chosen) - log pi_ref(chosen) fell to "
        f"{plain_low:.2f} nats (step {plain_step}) and ended at {last(plain_rows, 'logratio/chosen')}, while its pair accuracy ended at "
        f"{last(plain_rows, 'rewards/accuracy')}: the margin grew as the correct answers themselves became less likely. "
        + (f"The likelihood-displacement alarm rang: \"{alarms[0]}\". " if alarms else "The likelihood-displacement alarm did not reach its threshold. ")
        + f"With the NLL term the chosen log-ratio stayed at or above {rpo_low:.2f} (step {rpo_step}; it ended at "
        f"{last(dpo_rows, 'logratio/chosen')}), and held-out accuracy rose.", "",
        "![held-out accuracy](plots/heldout.png)", "",
        "![GRPO reward](plots/grpo_reward.png) ![GRPO held-out](plots/grpo_heldout.png)", "",
        "![GRPO KL](plots/grpo_kl.png) ![DPO loss](plots/dpo_loss.png) ![DPO accuracy](plots/dpo_accuracy.png)", "",
        "![DPO chosen log-ratio](plots/dpo_chosen.png)", "",
        "## The four links, side by side", "",
        "| link | SFT | GRPO | DPO (RPO) |", "|---|---|---|---|",
    ]
    for link in ("data", "reward", "loss", "acceptance"):
        row = [summarise(cards[name]["links"][link]) for name in ("sft", "grpo", "dpo")]
        lines.append(f"| {link} | " + " | ".join(row) + " |")
    lines += [
        "", f"The DPO pairs: {provenance['pairs']} (correct, incorrect) pairs from {provenance['prompts']} prompts, "
        f"labelled by verifier `{provenance['verifier']}` on samples of the SFT model; "
        f"{provenance['prompts_skipped_all_correct']} prompts skipped as all-correct, "
        f"{provenance['prompts_skipped_all_incorrect']} as all-incorrect.", "",
        "Full run cards: [SFT](sft/run_card.md), [GRPO](grpo/run_card.md), [DPO](dpo/run_card.md), [plain DPO](dpo_plain/run_card.md).", "",
        "## Sample held-out completions", "", "| problem | SFT start | after GRPO | after DPO (RPO) | plain DPO |", "|---|---|---|---|---|",
    ]
    rows = [json.loads((out / f"eval_{stage}.json").read_text())["rows"] for stage in labels]
    for index in range(min(config.samples_shown, len(rows[0]))):
        problem = rows[0][index]["prompt"].split("user\n")[-1].split("<|im_end|>")[0]
        cells = [f"`{r[index]['completion']}` ({r[index]['reason']})" for r in rows]
        lines.append(f"| `{problem}` | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _shift_reading(stages: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One sentence per shifted set: each stage's change from the SFT start with its paired 95%
    interval (same problems), and whether any stage moved it at all."""
    sentences, labels = [], {"grpo": "GRPO", "dpo": "RPO", "dpo_plain": "plain DPO"}
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
            gain, low, high = paired_difference_ci(start["correct"], stages[stage][name]["correct"])
            verdict = "a gain" if low > 0 else "a loss" if high < 0 else "no clear change"
            changes.append(f"{label} {stages[stage][name]['pass@1']:.3f} ({gain:+.3f} [{low:+.3f}, {high:+.3f}], {verdict})")
        sentences.append(f"`{name}` from {start['pass@1']:.3f} at the SFT start: " + "; ".join(changes) + ".")
    return " ".join(sentences)


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
        figure.tight_layout()
        figure.savefig(path, dpi=100)
    plt.close(figure)


def summarise(link: dict[str, Any], limit: int = 6) -> str:
    """A few key settings of one link, for the side-by-side table."""
    keep = [(k, v) for k, v in link.items() if not isinstance(v, (dict, list))][:limit]
    return "<br>".join(f"{k}: {v}" for k, v in keep).replace("|", "/")
