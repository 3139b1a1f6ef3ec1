"""SFT rows from a teacher's samples: `posttrain pairs --sft` (recipes/pairs.py samples G answers per
training prompt from the teacher, `--model`, and scores them; this picks the rows, counts them and
holds the output to a budget). The file is prompt / completion rows that `posttrain sft --data.task
FILE` trains on directly: the offline arm of on-policy distillation (the same teacher through a data
file instead of per-token log-probs).

    rows = TeacherRows(keep="all", threshold=1.0, distinct=False, budget=Budget(max_tokens=20000), tokenizer=tok)
    rows.add(example, texts, verdicts, truncated, origin)   # one prompt's G samples -> its rows
    rows.provenance()                                       # the sidecar's counts

`keep`: `all`, every sample (plain distillation: the teacher's distribution, its repeats included), or
`correct`, only the samples the verifier accepts (rejection-sampling fine-tuning, RFT: arXiv:2308.01825).
Empty completions are always dropped (an SFT row needs a non-empty completion); a repeat of an
earlier kept sample of the same prompt is counted, and dropped only with `distinct`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from posttrain.data.tokenize import encode_response

KEEP = {"all": "every sample (plain distillation)",
        "correct": "only the samples the verifier accepts (rejection sampling, RFT)"}
"""`--keep`: which of the teacher's samples become rows, and how the sidecar and card describe it."""


@dataclass
class Selected:
    """One prompt's samples picked for rows: their indices (sampling order) and what was left out."""

    indices: list[int]
    rejected: int = 0
    """keep correct: samples the verifier scored below the threshold."""
    unscored: int = 0
    """keep correct: samples whose verdict is an error (infra or data): not known correct."""
    duplicates: int = 0
    """Kept samples whose text repeats an earlier kept one of the prompt (dropped only when `distinct`)."""
    empty: int = 0
    """Empty or whitespace-only samples, always dropped (`posttrain sft` refuses an empty completion)."""


def is_correct(verdict, threshold: float) -> bool:
    return verdict.status == "ok" and verdict.reward is not None and verdict.reward >= threshold


def select_samples(texts: list[str], verdicts: list, keep: str, threshold: float, distinct: bool) -> Selected:
    """Which of one prompt's G samples become rows. Example: texts [a, a, "", b, c], rewards
    [1, 1, 1, 0, error], threshold 1: keep all -> [0, 1, 3, 4] (1 duplicate counted, 1 empty);
    keep correct, distinct -> [0] (1 duplicate dropped, 1 empty, 1 rejected, 1 unscored)."""
    selected, seen = Selected([]), set()
    for index, (text, verdict) in enumerate(zip(texts, verdicts)):
        if not text.strip():
            selected.empty += 1
            continue
        if keep == "correct" and not is_correct(verdict, threshold):
            if verdict.status == "ok" and verdict.reward is not None:
                selected.rejected += 1
            else:
                selected.unscored += 1
            continue
        if text in seen:
            selected.duplicates += 1
            if distinct:
                continue
        seen.add(text)
        selected.indices.append(index)
    return selected


@dataclass
class Budget:
    """A cap on the rows written and on their completion tokens (None: no cap). Rows are admitted in
    sampling order until the first that does not fit; from then on the budget is `full` and nothing
    more is admitted, so the file is a prefix of the sampling order (the teacher is not asked for more)."""

    max_rows: int | None = None
    max_tokens: int | None = None
    full: bool = False

    def admits(self, rows: int, tokens: int, next_tokens: int) -> bool:
        """Whether one more row of `next_tokens` fits after `rows` rows of `tokens` tokens."""
        if self.full or (self.max_rows is not None and rows + 1 > self.max_rows) or (
                self.max_tokens is not None and tokens + next_tokens > self.max_tokens):
            self.full = True
        return not self.full


@dataclass
class TeacherRows:
    """The SFT rows of every prompt so far and the counts the sidecar records. `tokenizer`: the
    teacher's, which counts each completion's tokens as `posttrain sft` encodes them (EOS excluded:
    SFT adds one per row, so its loss covers completion_tokens + rows tokens)."""

    keep: str
    threshold: float
    distinct: bool
    budget: Budget
    tokenizer: object
    rows: int = 0
    completion_tokens: int = 0
    samples: int = 0
    correct: int = 0
    prompts_with_rows: int = 0
    truncated: int = 0
    dropped: dict = field(default_factory=lambda: {"rejected": 0, "unscored": 0, "empty": 0, "duplicates": 0, "over_budget": 0})
    duplicates_seen: int = 0

    def add(self, example, texts: list[str], verdicts: list, truncated: list[bool], origin: dict[str, str]) -> list[dict]:
        """The rows of one prompt's G samples (`texts`, their `verdicts` and `truncated` flags):
        `{"id", "prompt", "completion", "metadata"}`, the completion a string, or an assistant
        message list when the prompt is messages (TRL's conversational prompt / completion)."""
        self.samples += len(texts)
        self.correct += sum(is_correct(verdict, self.threshold) for verdict in verdicts)
        selected = select_samples(texts, verdicts, self.keep, self.threshold, self.distinct)
        for name in ("rejected", "unscored", "empty"):
            self.dropped[name] += getattr(selected, name)
        self.duplicates_seen += selected.duplicates
        if self.distinct:
            self.dropped["duplicates"] += selected.duplicates
        prompt = example.prompt_input
        out = []
        for index in selected.indices:
            tokens = len(encode_response(self.tokenizer, texts[index], add_eos=False))
            if not self.budget.admits(self.rows, self.completion_tokens, tokens):
                self.dropped["over_budget"] += 1
                continue
            self.rows, self.completion_tokens, self.truncated = self.rows + 1, self.completion_tokens + tokens, self.truncated + truncated[index]
            completion = texts[index] if isinstance(prompt, str) else [{"role": "assistant", "content": texts[index]}]
            verdict = verdicts[index]
            out.append({"id": f"{example.id}/{index}", "prompt": prompt, "completion": completion,
                        "metadata": {"example": example.id, "reward": verdict.reward, "correct": is_correct(verdict, self.threshold),
                                     "truncated": bool(truncated[index]), "completion_tokens": tokens, **origin}})
        self.prompts_with_rows += bool(out)
        return out

    def provenance(self) -> dict:
        """The sidecar's part of an SFT-rows file: what was kept and why, and the counts."""
        return {"sft": True, "keep": self.keep, "keep_means": KEEP[self.keep], "distinct": self.distinct,
                "rows": self.rows, "completion_tokens": self.completion_tokens,
                "completion_tokens_note": "the teacher's tokenizer, EOS excluded (posttrain sft adds one per row)",
                "samples": self.samples, "samples_correct": self.correct, "prompts_with_rows": self.prompts_with_rows,
                "rows_truncated": self.truncated, "duplicates": self.duplicates_seen,
                "dropped": dict(self.dropped), "max_rows": self.budget.max_rows, "max_tokens": self.budget.max_tokens,
                "budget_reached": self.budget.full}

    def explain(self, prompts: int, group_size: int) -> str:
        """Why no row was written, in one line."""
        dropped = self.dropped
        reasons = (f"{dropped['rejected']} rejected by the verifier, {dropped['unscored']} unscored, " if self.keep == "correct" else "")
        return (f"no SFT rows: of {self.samples} samples ({prompts} prompts x G={group_size}), --keep {self.keep} kept none "
                f"({reasons}{dropped['empty']} empty, {dropped['over_budget']} over the --max-rows/--max-tokens budget); nothing written")
