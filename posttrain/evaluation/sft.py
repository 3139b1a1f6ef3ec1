"""SFT's acceptance link: held-out accuracy of a task's gold-answer form (greedy, the task's checker,
the shifted sets beside it) and the held-out NLL of the response tokens (always; the only measure
of a file's SFT rows), and the run card's acceptance part that describes them.

    metrics = heldout_metrics(model, tokenizer, data, HeldoutSettings(seed, 24, None, 32), eval_dir, step)

`posttrain.recipes.sft` calls these on its eval schedule and plots what they return.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.data.sft_data import SFTData
from posttrain.data.tokenize import TokenizedBatch
from posttrain.distributed import is_sharded
from posttrain.evaluation.acceptance import IN_DISTRIBUTION, evaluate_sets
from posttrain.losses.sft import sft_loss
from posttrain.models.forward import TrainingForward, batch_response_sums


@dataclass(frozen=True)
class HeldoutSettings:
    """What a held-out evaluation of SFT needs from the run's config."""

    seed: int
    max_new_tokens: int
    """Generation budget of the held-out accuracy (a task's gold-answer form only)."""
    system_prompt: str | None
    micro_batch_size: int
    """Rows per forward of the held-out NLL."""


def heldout_metrics(model, tokenizer, data: SFTData, settings: HeldoutSettings, eval_dir: Path, step: int) -> dict:
    """A task's held-out accuracy on each held-out set (written to `eval_dir`; `evaluate_sets`' metrics)
    when `data.task` is set, then "heldout/nll", the held-out NLL (always). `model` is in eval mode."""
    if data.task is None:
        return {"heldout/nll": heldout_nll(model, data.encode(data.held_out), settings.micro_batch_size)}
    _, metrics = evaluate_sets(model, tokenizer, data.task, data.checker, data.shifted, step=step, eval_dir=eval_dir,
                               seed=settings.seed, max_new_tokens=settings.max_new_tokens, system_prompt=settings.system_prompt)
    metrics["heldout/nll"] = heldout_nll(model, data.encode(data.held_out), settings.micro_batch_size)
    return metrics


@torch.no_grad()
def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def heldout_nll(model, batch: TokenizedBatch, micro_batch_size: int) -> float:
    """Token-mean NLL of the masked (response) tokens of a held-out batch ((N, L) rows), summed over
    micro-batches of at most `micro_batch_size` rows, each normalised by the whole batch's tokens."""
    rows = batch.input_ids.shape[0]
    batch = batch.to(_device_of(model))
    global_tokens = batch.mask[:, 1:].sum()
    forward = TrainingForward(model, batch_response_sums, full_forward=is_sharded(model))  # under the caller's autocast
    return sum(
        sft_loss(forward, batch, slice(start, start + micro_batch_size), global_tokens).item()
        for start in range(0, rows, micro_batch_size)
    )


def acceptance_card(data: SFTData, task: str, checker: str | None) -> dict:
    """The run card's acceptance link: the held-out split of the task spec `task` and its checker
    (`checker`: the acceptance.checker setting, None for the task's default), with the resolved
    checker's settings and the held-out sets; for SFT rows, the held-out rows and their NLL."""
    if data.rows_file:
        card = {"heldout": f"{len(data.held_out)} held-out rows of {task}", "metric": "token-mean NLL"}
        if data.task is not None:
            spec = data.card["heldout_task"]
            card.update({"heldout_task": f"{spec['task']} held-out split ({spec['eval_size']} problems, split seed {spec['split_seed']}, "
                                         "disjoint from the rows' prompts)", "checker": data.checker.name})
            task = spec["task"]
    else:
        card = {"heldout": f"{task} eval split", "checker": checker or "task default (strict)"}
    if data.checker is not None:
        imitated = "rows' completions" if data.rows_file else "gold answers"
        card.update({
            "checker_settings": data.checker.describe(), "independent": True,
            "independence_reason": f"SFT has no reward: it imitates the {imitated}, which the checker {data.checker.name} scores",
            "sets": {IN_DISTRIBUTION: {"task": task, "size": len(data.task), "checker": data.checker.name},
                     **{held.name: held.spec for held in data.shifted}}})
    return card
