"""`rm:DIR`: a learned reward model (a `posttrain rm` export, or any directory with its
reward_model.json) as a reward kind. It scores in the caller's process, batched, on the run's device
and precision (the registry's context); under torchrun each rank scores its own rows.

Each row is re-rendered with the reward model's OWN tokenizer and chat template from the row's
conversation (`messages`, else `prompt`), the system prompt the model was trained with, then the
completion and exactly one EOS (`data.tokenize.encode_prompt` / `encode_response`: the rendering
`posttrain rm` trained on), so the policy and the reward model may use different tokenizers. A row
longer than the model's context loses prompt tokens from the left, then response tokens from the
right (the EOS kept); both are counted in the verdict's details and `self.truncated`.

    verifier = get_verifier("rm:runs/rm/final", placement=placement)
    verdicts = verifier.batch(completions, rows)   # Verdict.ok(normalised reward, ..., raw=r)

Normalisation (`reward_options.normalisation`): `stored` (default) (r - mean) / std with the
population std stored at export; `batch`: over the batch's rows; `none`. Then
`reward_options.clip` c clamps to [-c, c]. Identity for independence: the weights' sha256.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.data.tokenize import encode_prompt, encode_response
from posttrain.errors import UserError
from posttrain.hardware import cpu_placement
from posttrain.models.reward_model import load_reward_model, shared_prompt_rewards, weights_hash
from posttrain.rewards.base import Verifier
from posttrain.rewards.verdict import Verdict

logger = logging.getLogger(__name__)

NORMALISATIONS = ("stored", "batch", "none")


@contextlib.contextmanager
def scoring_on_device(verifier, rows: int, what: str):
    """A model-based reward's scoring call: `verifier.model` on `verifier.placement`'s device for the
    call (moved there and back to the CPU around it under `verifier.offload`), yielding the device;
    running out of memory is one line naming the scoring knobs (`rows` completions,
    `verifier.batch_size` per forward; `what` names the model)."""
    if verifier.offload:
        verifier.model.to(verifier.placement.device)
    try:
        yield verifier.placement.device
    except torch.OutOfMemoryError as error:
        raise UserError(f"{verifier.name}: out of memory while scoring {rows} completions, {verifier.batch_size} per forward "
                        f"({str(error).splitlines()[0]}); lower reward_options.batch_size, or set reward_options.offload cpu to keep "
                        f"{what} off the GPU between scoring calls") from None
    finally:
        if verifier.offload:
            verifier.model.to("cpu")


class RewardModelVerifier(Verifier):
    """Scores completions with a reward model directory (see the module docstring)."""

    in_worker = False

    def __init__(self, directory: str, placement=None, batch_size: int = 16, normalisation: str = "stored",
                 clip: float | None = None, offload: str | None = None):
        if normalisation not in NORMALISATIONS:
            raise ValueError(f"rm:{directory}: reward_options.normalisation must be one of {', '.join(NORMALISATIONS)}, got {normalisation!r}")
        self.directory, self.placement = directory, placement or cpu_placement()
        self.name = f"rm:{directory}"
        self.batch_size, self.normalisation, self.clip, self.offload = batch_size, normalisation, clip, offload
        self.model, self.tokenizer, self.meta = load_reward_model(directory, dtype=self.placement.param_dtype,
                                                                  device="cpu" if offload else self.placement.device)
        if normalisation == "stored" and not self.meta.get("reward_std_population"):
            raise ValueError(f"rm:{directory}: its reward_model.json stores no reward scale; use reward_options.normalisation batch or none")
        self.max_tokens = getattr(self.model.config, "max_position_embeddings", None)
        self.truncated = {"prompt": 0, "response": 0}
        self._identity: str | None = None

    def render(self, completion: str, example: Mapping[str, Any]) -> tuple[list[int], dict[str, int]] | None:
        """The token ids the reward model scores for one row (prompt from `messages` or `prompt`,
        the model's system prompt and template, the completion, one EOS), truncated to its context;
        None when the row has no prompt."""
        parts = self.render_parts(completion, example)
        return None if parts is None else (parts[0] + parts[1], parts[2])

    def render_parts(self, completion: str, example: Mapping[str, Any]) -> tuple[list[int], list[int], dict[str, int]] | None:
        """`render`'s prompt ids and response ids apart (the scoring forward computes a prompt shared
        by several rows once), and the truncation counts; None when the row has no prompt."""
        prompt = example.get("messages") or example.get("prompt")
        if not prompt:
            return None
        prompt_ids = encode_prompt(self.tokenizer, prompt, system_prompt=self.meta.get("system_prompt"),
                                   use_chat_template=self.meta.get("use_chat_template"))
        response_ids = encode_response(self.tokenizer, completion)
        cut = {"prompt": 0, "response": 0}
        if self.max_tokens and len(prompt_ids) + len(response_ids) > self.max_tokens:
            keep = max(0, self.max_tokens - len(response_ids))
            cut["prompt"] = len(prompt_ids) - keep
            prompt_ids = prompt_ids[len(prompt_ids) - keep :]
            if len(response_ids) > self.max_tokens:
                cut["response"] = len(response_ids) - self.max_tokens
                response_ids = response_ids[: self.max_tokens - 1] + [self.tokenizer.eos_token_id]
        return prompt_ids, response_ids, cut

    def raw_rewards(self, sequences: list[list[int]], prompt_lengths: Sequence[int] | None = None) -> torch.Tensor:
        """(n,) float32 rewards of token id lists, `batch_size` at a time, right-padded (pooling
        reads the attention mask, so the padding's ids never matter). Given each sequence's
        `prompt_lengths`, rows of a batch that share a prompt (a group's samples) compute it once
        (`models.reward_model.shared_prompt_rewards`, equal to the plain forward up to float
        rounding). With `offload` the model visits the run's device for the call only. Out of
        memory is one line naming the scoring knobs."""
        with scoring_on_device(self, len(sequences), "the reward model") as device:
            return self._raw_rewards(sequences, device, prompt_lengths)

    @torch.no_grad()
    def _raw_rewards(self, sequences: list[list[int]], device, prompt_lengths: Sequence[int] | None = None) -> torch.Tensor:
        out = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            width = max(len(ids) for ids in chunk)
            input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
            attention = torch.zeros(len(chunk), width, dtype=torch.long)
            response = torch.zeros(len(chunk), width, dtype=torch.bool)
            for row, ids in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention[row, : len(ids)] = 1
                if prompt_lengths is not None:
                    response[row, prompt_lengths[start + row] : len(ids)] = True
            input_ids, attention = input_ids.to(device), attention.to(device)
            with self.placement.autocast():
                rewards = shared_prompt_rewards(self.model, input_ids, attention, response.to(device)) if prompt_lengths is not None else None
                if rewards is None:
                    rewards = self.model(input_ids, attention)
            out.append(rewards.float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def normalise(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.normalisation == "stored":
            rewards = (rewards - self.meta["reward_mean"]) / self.meta["reward_std_population"]
        elif self.normalisation == "batch" and rewards.numel() > 1:
            rewards = (rewards - rewards.mean()) / rewards.std(correction=0).clamp(min=1e-6)
        return rewards.clamp(-self.clip, self.clip) if self.clip else rewards

    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]], workers: int | None = None) -> list[Verdict]:
        """One verdict per row: ok with the normalised reward (details: raw, truncated tokens), or
        data_error for a row without a prompt."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        rendered = [self.render_parts(completion, example) if isinstance(completion, str) else None
                    for completion, example in zip(completions, examples)]
        scored = [index for index, item in enumerate(rendered) if item is not None]
        raw = self.raw_rewards([rendered[index][0] + rendered[index][1] for index in scored],
                               prompt_lengths=[len(rendered[index][0]) for index in scored])
        rewards = self.normalise(raw)
        verdicts = [Verdict.data_error("rm: the row has no prompt or messages to render") for _ in completions]
        for position, index in enumerate(scored):
            cut = rendered[index][2]
            for side in cut:
                self.truncated[side] += bool(cut[side])
            verdicts[index] = Verdict.ok(float(rewards[position]), f"reward model ({self.normalisation})", raw=float(raw[position]),
                                         truncated_tokens=cut)
        return verdicts

    def score(self, completion: str, example: Mapping[str, Any]) -> Verdict:
        return self.batch([completion], [example])[0]

    def implementation(self) -> dict[str, str]:
        """Its identity is its weights: the same reward model as reward and checker is not independent."""
        if self._identity is None:
            self._identity = weights_hash(self.model)
        return {"reward_model": f"weights sha256 {self._identity}"}

    def describe(self) -> dict[str, Any]:
        return {"verifier": self.name, "kind": "learned reward model", "normalisation": self.normalisation, "clip": self.clip,
                "batch_size": self.batch_size, "offload": self.offload, "stored_mean": self.meta.get("reward_mean"),
                "stored_std_population": self.meta.get("reward_std_population"), "heldout_accuracy": self.meta.get("heldout_accuracy"),
                "base_model": self.meta.get("base_model"), "rendering": "the reward model's own tokenizer and chat template, one EOS",
                "device": str(self.placement.device)}
