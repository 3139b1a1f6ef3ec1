"""`teacher:MODEL`: a teacher model scoring every token the student sampled (on-policy distillation).

The reward of the student's own sample is dense: at each sampled token t,

    r_t = log p_teacher(y_t | prefix) - log p_student(y_t | prefix)

(`algorithms/distill.py`: minus the k1 estimate of the reverse KL per token). This module is the
teacher's half: it loads the teacher once, frozen and in eval mode, on the run's device and
precision, checks that it shares the policy's tokenizer (the teacher reads the student's token ids
as they are), and gives each sampled batch the teacher's log-probs of its tokens (`token_terms`,
each rank its own rows under torchrun). The student's half, its log-probs before the update, is the
loss link's (`losses/policy_gradient.prepare`), which turns the two into token rewards for the
advantage estimator (`loss.advantage distill`: each token's own; the others as documented in
docs/rewards.md). As a sequence-level verifier a teacher scores 0, so in a weighted sum
(`teacher:DIR+0.5*exact`) the sequence reward is the other terms'.

The teacher's log-probs are taken at the sampling temperature, as the student's are: with teacher =
student every token's reward is exactly 0, and a student whose tempered distribution matches the
teacher's tempered one matches it at temperature 1 too.

    verifier = get_verifier("teacher:runs/grpo/final", placement=placement)   # via the registry
    terms = verifier.token_terms(rollout, owners, world)   # [TokenTerm("teacher:...", 1.0, (N, T) log-probs)]
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.errors import UserError
from posttrain.hardware import cpu_placement
from posttrain.models.forward import rank_logprobs
from posttrain.models.loading import load_model
from posttrain.models.reward_model import weights_hash
from posttrain.rewards.base import TokenTerm, Verifier
from posttrain.rewards.reward_model import scoring_on_device
from posttrain.rewards.verdict import Verdict

logger = logging.getLogger(__name__)


def teacher_directory(spec: str) -> str:
    """The model spec a `teacher:` names: a run directory (with `final/` and no config.json of its
    own) means its `final` export; anything else (a model directory, `tiny`, `smollm2-135m`) as is."""
    path = Path(spec).expanduser()
    if path.is_dir() and not (path / "config.json").is_file() and (path / "final").is_dir():
        return str(path / "final")
    return spec


def tokenizer_mismatch(teacher, student) -> str | None:
    """Why two tokenizers cannot share token ids (None: they can): a different vocabulary (size,
    or any token's id) or a different EOS."""
    teacher_vocab, student_vocab = teacher.get_vocab(), student.get_vocab()
    if len(teacher_vocab) != len(student_vocab):
        return f"vocabulary of {len(teacher_vocab)} tokens vs the policy's {len(student_vocab)}"
    if teacher_vocab != student_vocab:
        token = next(t for t in student_vocab if teacher_vocab.get(t) != student_vocab[t])
        return f"token {token!r} has id {teacher_vocab.get(token)} vs the policy's {student_vocab[token]}"
    if teacher.eos_token_id != student.eos_token_id:
        return f"EOS id {teacher.eos_token_id} vs the policy's {student.eos_token_id}"
    return None


class TeacherReward(Verifier):
    """A frozen teacher's per-token log-probs of the student's samples (see the module docstring)."""

    in_worker = False
    dense = True

    def __init__(self, spec: str, placement=None, tokenizer=None, temperature: float = 1.0, batch_size: int = 16,
                 offload: str | None = None):
        if not spec.strip():
            raise ValueError("teacher:<model>: name the teacher, e.g. teacher:runs/grpo/final (a run's export, a model directory or smollm2-135m)")
        self.spec, self.name = spec, f"teacher:{spec}"
        self.placement = placement or cpu_placement()
        self.temperature, self.batch_size, self.offload = temperature, batch_size, offload
        self.model, self.tokenizer = load_model(teacher_directory(spec), dtype=self.placement.param_dtype,
                                                device="cpu" if offload else self.placement.device)
        self.model.requires_grad_(False)
        self.model.eval()
        if tokenizer is not None:
            why = tokenizer_mismatch(self.tokenizer, tokenizer)
            if why:
                raise UserError(f"reward {self.name}: the teacher's tokenizer differs from the policy's ({why}); on-policy "
                                "distillation scores the student's token ids with the teacher, so both need one tokenizer")
        self._identity: str | None = None

    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]], workers: int | None = None) -> list[Verdict]:
        """The sequence part: 0 for every row (the teacher's reward is per token, `token_terms`)."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        return [Verdict.ok(0.0, "teacher: scored per token (log p_teacher - log p_student)") for _ in completions]

    def score(self, completion: str, example: Mapping[str, Any]) -> Verdict:
        return self.batch([completion], [example])[0]

    def token_terms(self, rollout, owners, world) -> list[TokenTerm]:
        """[one term, weight 1: the teacher's (N, T) float32 log-probs of `rollout`'s sampled tokens at
        the sampling temperature, 0 off its mask], computed on the run's device, `batch_size` rows
        per forward, each rank its own rows (`owners`), on the rollout's device."""
        with scoring_on_device(self, rollout.completion_ids.shape[0], "the teacher") as device:
            logprobs = rank_logprobs(self.model, rollout.to(device), owners, world, self.temperature, self.batch_size)
        return [TokenTerm(self.name, 1.0, logprobs.to(rollout.completion_ids.device))]

    def implementation(self) -> dict[str, str]:
        """Its identity is its weights (a teacher used as the held-out checker's model is not independent)."""
        if self._identity is None:
            self._identity = weights_hash(self.model)
        return {"teacher": f"weights sha256 {self._identity}"}

    def describe(self) -> dict[str, Any]:
        return {"verifier": self.name, "kind": "teacher (on-policy distillation: per-token log p_teacher - log p_student)",
                "model": teacher_directory(self.spec), "temperature": self.temperature, "batch_size": self.batch_size,
                "offload": self.offload, "device": str(self.placement.device)}
