"""The budget every row of `posttrain compare` (compare.py) shares, and the offline rows' samples
sized by it (its step 3): each file is `posttrain pairs` in a process of its own (compare_process.py).

- `pairs`: one pairs file from the start, labelled by `REWARD`, as many sampled answers as each
  online row draws (steps x `PROMPTS_PER_STEP` x `GROUP_SIZE`): every offline row trains on it, but KTO;
- `unpaired`: KTO's unpaired rows of the same samples (`posttrain pairs --unpaired`, the same seed:
  every distinct scored answer, the groups pairing skips included);
- `teacher_sft`: the teacher's samples as SFT rows (`posttrain pairs --sft --keep all`), as many as
  the distillation row scores (`teacher_samples`); the SFT row trains one epoch on them (`sft_steps`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.data.provenance import provenance_path
from posttrain.recipes.compare_process import run_child

logger = logging.getLogger(__name__)

PROMPTS_PER_STEP, GROUP_SIZE = 16, 8
"""Every online row's budget per step (presets/tiny-grpo.yaml's; PPO's preset draws 32 x 2, set to this)."""
PAIRS_PER_STEP = 16
"""Every offline row's pairs per step (the demo's DPO stage, docs/algorithms.md §3d)."""
REWARD = "exact"
"""The online rows' reward and the pairs' labeller; the held-out checker is `integer` (demo.acceptance)."""
SFT_BATCH_SIZE = 32
"""The SFT row's rows per step (presets/tiny-sft.yaml's, given explicitly so the step arithmetic holds whatever the preset says)."""
SFT_HELDOUT_ROWS = 8
"""Rows of the teacher's file the SFT row holds out for its own held-out NLL (at least 1: `posttrain
sft` needs a split); its acceptance is scored here on the shared sets like every row's."""


@dataclass(frozen=True)
class Sampling:
    """What every offline file is sampled with: the comparison's budget and held-out split, the start's task."""

    steps: int
    """--steps: each file holds as many answers as an online row draws in as many steps."""
    eval_size: int
    """--eval-size: the held-out problems the prompts are kept apart from."""
    seed: int
    task: str
    task_options: dict[str, Any]
    max_new_tokens: int
    """The start's answer budget (its SFT stage's acceptance.max_new_tokens)."""


@dataclass
class OfflineFiles:
    """The offline rows' files, by kind (a row's `data`: pairs, unpaired, teacher_sft)."""

    paths: dict[str, Path]
    provenance: dict[str, dict]
    """Each file's sidecar: of each sampled one, and --pairs' when given."""
    errors: dict[str, str | None]
    """Each sampled file's one-line error, or None."""


def offline_paths(out: Path, pairs: str | None) -> dict[str, Path]:
    """Where each kind of file is: in `out`, but --pairs (`pairs`) serves as both the pairs and the unpaired rows."""
    paths = {"pairs": Path(pairs).resolve() if pairs else out / "pairs.jsonl", "teacher_sft": out / "teacher_sft.jsonl"}
    paths["unpaired"] = paths["pairs"] if pairs else out / "unpaired.jsonl"
    return paths


def sample_offline_files(kinds: list[str], models: dict[str, str | None], paths: dict[str, Path], sampling: Sampling,
                         logs: Path, threads: int) -> OfflineFiles:
    """Sample the offline rows' files (`kinds`: pairs, unpaired from `models["start"]`; teacher_sft
    from `models["teacher"]`), each with `posttrain pairs` in its own process (`sampling_arguments`,
    its log in `logs`); returns each file's sidecar and each file's one-line error or None."""
    provenance, errors = {}, {}
    for kind in kinds:
        model = models["teacher" if kind == "teacher_sft" else "start"]
        seconds, _, errors[kind] = run_child(sampling_arguments(kind, model, paths[kind], sampling), logs / f"{kind}.log", threads)
        if errors[kind] is None:
            provenance[kind] = json.loads(provenance_path(paths[kind]).read_text())
            logger.info("%s: %s rows from %s prompts (%.0f s)", kind, provenance[kind].get("pairs", provenance[kind].get("rows")),
                        provenance[kind].get("prompts"), seconds)
        else:
            logger.info("%s: failed: %s", kind, errors[kind])
    return OfflineFiles(paths, provenance, errors)


def sampling_arguments(kind: str, model: str, out_file: Path, sampling: Sampling) -> list[str]:
    """`posttrain pairs` arguments of one offline file: G samples of each of steps x prompts per step
    training prompts (as many answers as each online row draws; the start's held-out split kept apart),
    labelled by `REWARD`; `unpaired`: KTO's rows of the same samples; `teacher_sft`: the teacher's
    samples as SFT rows, every one kept, exactly `teacher_samples` of them (as many as the
    distillation row scores: a quarter more prompts are offered, and --max-rows stops the sampling there)."""
    kind_flags = {"pairs": [], "unpaired": ["--unpaired"],
                  "teacher_sft": ["--sft", "--keep", "all", "--max-rows", str(teacher_samples(sampling.steps))]}[kind]
    prompts = sampling.steps * PROMPTS_PER_STEP
    if kind == "teacher_sft":  # a quarter more prompts than the rows need, so that --max-rows, not the prompts the held-out
        prompts += prompts // 4  # split removes from the first ones (44 of 800 at seed 0), sets the file's size exactly
    return ["pairs", "--model", model, "--out", str(out_file), "--group_size", str(GROUP_SIZE), "--verifier", REWARD,
            "--data.task", sampling.task, "--data.task_options", json.dumps(sampling.task_options),
            "--data.max_prompts", str(prompts), "--data.eval_size", str(sampling.eval_size),
            "--sampling.max_new_tokens", str(sampling.max_new_tokens), "--seed", str(sampling.seed), *kind_flags]


def teacher_samples(steps: int) -> int:
    """The teacher's samples the SFT row gets: as many as the distillation row scores, steps x
    prompts per step x G (12 steps: 12 x 16 x 8 = 1536)."""
    return steps * PROMPTS_PER_STEP * GROUP_SIZE


def sft_steps(rows: int) -> int:
    """The SFT row's steps: one epoch over the teacher's rows less the `SFT_HELDOUT_ROWS` held out,
    `SFT_BATCH_SIZE` a step, at least 1 (1536 rows: (1536 - 8) // 32 = 47 steps, on 47 x 32 = 1504
    rows, its data.train_size: the 24 left over would not fill a step)."""
    return max(1, (rows - SFT_HELDOUT_ROWS) // SFT_BATCH_SIZE)
