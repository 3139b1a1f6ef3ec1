"""`posttrain demo` (what `make demo` runs): the whole product on the built-in tiny model, for real.

1. SFT trains the tiny model from scratch on 2-digit addition, just to partial competence.
2. Baseline acceptance: held-out accuracy with the independent checker.
3. GRPO from that start, rewarded by a program (RLVR).
4. `pairs` from the SFT model (verifier-labelled) and DPO on them, from the same start, with a
   comparable budget (as many sampled answers as GRPO generated).
5. Acceptance again for both, on the same held-out problems (paired confidence intervals).
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
from posttrain.evaluation.acceptance import evaluate_task, heldout_split  # noqa: E402
from posttrain.evaluation.stats import paired_difference_ci  # noqa: E402
from posttrain.models import load_model  # noqa: E402
from posttrain.runs import read_jsonl  # noqa: E402

logger = logging.getLogger(__name__)


PRESETS = Path(__file__).resolve().parents[2] / "presets"
"""The repository's presets: each demo stage is one of them plus the overrides below."""

DPO_STAGE = {"loss": {"nll_weight": 0.0}, "optim": {"lr": 3e-5}, "batch_size": 16, "micro_batch_size": 16,
             "data": {"heldout_pairs": 0}}
"""The demo's DPO stage is plain DPO (tiny-dpo.yaml is RPO: DPO plus the chosen answers' NLL) on every
pair, with as many steps as GRPO: "same reward link, different data link", not the best DPO."""


@dataclass
class Config:
    output_dir: str = "runs/demo"
    """Where the stages and the report go (replaced if it holds an earlier demo)."""
    seed: int = 0
    """One seed for every stage."""
    eval_size: int = 500
    """Held-out problems, never trained on, scored by the `integer` checker (written apart from the
    `exact` training reward and labeller: posttrain/rewards/checkers.py)."""
    sft_steps: int = 400
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


def run(config: Config, resume: bool = False) -> Path:
    """Run every stage; returns the demo directory (with report.md and summary.json)."""
    from posttrain.recipes import dpo, dpo_config, online, online_config, pairs, sft

    if resume:
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
        "checkpoint_every": config.sft_steps, "eval_every": 0,
    })
    sft_dir = Path(config.sft_run) if config.sft_run else sft.run(sft_config)
    start_model = str(sft_dir / "checkpoints" / f"step-{config.sft_steps:06d}" / "model")
    if not Path(start_model).is_dir():
        raise UserError(f"{start_model}: no SFT checkpoint at step {config.sft_steps}")
    timings["sft"] = time.perf_counter() - clock
    task, options, budget = sft_config.data.task, sft_config.data.task_options, sft_config.max_new_tokens

    # 2. Baseline acceptance on the held-out split every stage shares.
    held_out = heldout_split(task, config.eval_size, seed, options)
    before = acceptance(start_model, held_out, budget, seed, out / "eval_sft.json")

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
    dpo_dir = dpo.run(build_config(dpo_config.Config, preset("tiny-dpo"), {
        **DPO_STAGE, "seed": seed, "model": start_model, "output_dir": str(out / "dpo"), "max_steps": config.grpo_steps,
        "checkpoint_every": config.grpo_steps, "data": {**DPO_STAGE["data"], "pairs": str(pairs_file)},
        "acceptance": {"max_new_tokens": budget},
    }))
    timings["dpo"] = time.perf_counter() - clock

    # 5. Acceptance for both on the same problems.
    after_grpo = acceptance(str(grpo_dir / "checkpoints" / f"step-{config.grpo_steps:06d}" / "model"), held_out, budget, seed, out / "eval_grpo.json")
    after_dpo = acceptance(str(dpo_dir / "checkpoints" / f"step-{config.grpo_steps:06d}" / "model"), held_out, budget, seed, out / "eval_dpo.json")

    # 6. Report.
    gain, low, high = paired_difference_ci(before["correct"], after_grpo["correct"])
    dpo_gain = paired_difference_ci(before["correct"], after_dpo["correct"])
    summary = {
        "heldout_before": before["pass@1"], "heldout_after_grpo": after_grpo["pass@1"],
        "heldout_after_dpo": after_dpo["pass@1"], "n_heldout": before["n"], "gain_grpo_ci95": [low, high],
        "seconds_after_install": time.perf_counter() - started,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_report(out, config, grpo_config, summary, before, after_grpo, after_dpo, (gain, low, high), dpo_gain, provenance,
                 timings, {"sft": sft_dir, "grpo": grpo_dir, "dpo": dpo_dir})
    return out


def acceptance(model_dir: str, held_out, budget: int, seed: int, path: Path) -> dict[str, Any]:
    model, tokenizer = load_model(model_dir)
    return evaluate_task(model, tokenizer, held_out, checker="integer", max_new_tokens=budget, seed=seed, output_path=path)


def write_report(out: Path, config: Config, grpo_config, summary, before, after_grpo, after_dpo, grpo_gain, dpo_gain, provenance, timings, dirs) -> None:
    """report.md with the before/after table, curves, the run cards side by side and samples."""
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    labels = ["SFT start", "after GRPO", "after DPO"]
    results = [before, after_grpo, after_dpo]
    figure, axis = plt.subplots(figsize=(5.5, 3.5))
    values = [r["pass@1"] for r in results]
    errors = [[v - r["pass@1_ci95"][0] for v, r in zip(values, results)], [r["pass@1_ci95"][1] - v for v, r in zip(values, results)]]
    axis.bar(labels, values, yerr=errors, capsize=6, color=["#999999", "#2b7bba", "#d9822b"])
    axis.set_ylabel(f"held-out accuracy (n={summary['n_heldout']})")
    axis.set_ylim(0, 1)
    axis.set_title("Held-out accuracy, 95% Wilson intervals")
    figure.tight_layout()
    figure.savefig(plots / "heldout.png", dpi=100)
    plt.close(figure)
    grpo_rows = read_jsonl(dirs["grpo"] / "metrics.jsonl")
    dpo_rows = read_jsonl(dirs["dpo"] / "metrics.jsonl")
    curves = [
        ("grpo_reward.png", grpo_rows, "reward/mean", "GRPO training reward (exact match)"),
        ("grpo_heldout.png", grpo_rows, "heldout/pass@1", "GRPO held-out accuracy"),
        ("grpo_kl.png", grpo_rows, "kl/exact", "GRPO exact KL to the SFT start"),
        ("dpo_loss.png", dpo_rows, "loss", "DPO loss"),
        ("dpo_accuracy.png", dpo_rows, "rewards/accuracy", "DPO pair accuracy (implicit reward)"),
    ]
    for name, rows, key, title in curves:
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if not points:
            continue
        figure, axis = plt.subplots(figsize=(5.5, 3.2))
        axis.plot(*zip(*points), marker="o" if len(points) < 25 else None)
        axis.set_xlabel("step")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(plots / name, dpi=100)
        plt.close(figure)

    def last(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{values[-1]:.3f}" if values else "n/a"

    def cell(result):
        low, high = result["pass@1_ci95"]
        return f"{result['pass@1']:.3f} [{low:.3f}, {high:.3f}]"

    gain, low, high = grpo_gain
    cards = {name: json.loads((path / "run_card.json").read_text()) for name, path in dirs.items()}
    lines = [
        "# posttrain demo: what each link changed", "",
        f"Tiny character-level Llama (3.2M parameters) on 2-digit addition; {summary['n_heldout']} held-out problems "
        "never seen in training, scored by the `integer` checker (the `<answer>` element read by an HTML parser, "
        "its text parsed by `int()`), implemented apart from the `exact` training reward and labeller. One seed "
        f"({config.seed}); {summary['seconds_after_install']:.0f} s in all on this machine.", "",
        "| stage | held-out accuracy [95% CI] | training reward (last step) | KL to start | mean length | wall time |",
        "|---|---|---|---|---|---|",
        f"| SFT start ({config.sft_steps} steps) | {cell(before)} | n/a | 0 | {before['mean_length']:.1f} | {timings['sft']:.0f} s |",
        f"| GRPO ({config.grpo_steps} steps x {grpo_config.data.prompts_per_step * grpo_config.data.group_size} samples) | {cell(after_grpo)} | "
        f"{last(grpo_rows, 'reward/mean')} | {last(grpo_rows, 'kl/exact')} | {after_grpo['mean_length']:.1f} | {timings['grpo']:.0f} s |",
        f"| DPO ({config.grpo_steps} steps on {provenance['pairs']} pairs) | {cell(after_dpo)} | "
        f"{last(dpo_rows, 'rewards/accuracy')} (pair accuracy) | n/a | {after_dpo['mean_length']:.1f} | "
        f"{timings['pairs'] + timings['dpo']:.0f} s (pairs {timings['pairs']:.0f} s) |",
        "",
        f"GRPO gain over the start: {gain:+.3f}, 95% CI [{low:+.3f}, {high:+.3f}] (paired over the same problems). "
        f"DPO gain: {dpo_gain[0]:+.3f}, 95% CI [{dpo_gain[1]:+.3f}, {dpo_gain[2]:+.3f}].", "",
        "How to read it: the interval is what matters; a gain whose interval excludes 0 is unlikely to be noise. "
        "Training reward is what the optimizer saw; held-out accuracy, from problems it never saw, is the acceptance.", "",
        "![held-out accuracy](plots/heldout.png)", "",
        "![GRPO reward](plots/grpo_reward.png) ![GRPO held-out](plots/grpo_heldout.png)", "",
        "![GRPO KL](plots/grpo_kl.png) ![DPO loss](plots/dpo_loss.png) ![DPO accuracy](plots/dpo_accuracy.png)", "",
        "## The four links, side by side", "",
        "| link | SFT | GRPO | DPO |", "|---|---|---|---|",
    ]
    for link in ("data", "reward", "loss", "acceptance"):
        row = [summarise(cards[name]["links"][link]) for name in ("sft", "grpo", "dpo")]
        lines.append(f"| {link} | " + " | ".join(row) + " |")
    lines += [
        "", f"The DPO pairs: {provenance['pairs']} (correct, incorrect) pairs from {provenance['prompts']} prompts, "
        f"labelled by verifier `{provenance['verifier']}` on samples of the SFT model; "
        f"{provenance['prompts_skipped_all_correct']} prompts skipped as all-correct, "
        f"{provenance['prompts_skipped_all_incorrect']} as all-incorrect.", "",
        "Full run cards: [SFT](sft/run_card.md), [GRPO](grpo/run_card.md), [DPO](dpo/run_card.md).", "",
        "## Sample held-out completions", "", "| problem | SFT start | after GRPO | after DPO |", "|---|---|---|---|",
    ]
    rows = [json.loads(p.read_text())["rows"] for p in (out / "eval_sft.json", out / "eval_grpo.json", out / "eval_dpo.json")]
    for index in range(min(config.samples_shown, len(rows[0]))):
        problem = rows[0][index]["prompt"].split("user\n")[-1].split("<|im_end|>")[0]
        cells = [f"`{r[index]['completion']}` ({r[index]['reason']})" for r in rows]
        lines.append(f"| `{problem}` | " + " | ".join(cells) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


def summarise(link: dict[str, Any], limit: int = 6) -> str:
    """A few key settings of one link, for the side-by-side table."""
    keep = [(k, v) for k, v in link.items() if not isinstance(v, (dict, list))][:limit]
    return "<br>".join(f"{k}: {v}" for k, v in keep).replace("|", "/")
