"""A local LLM judge as a reward: `judge:MODEL` (MODEL: any spec `posttrain.models.load_model` takes).

Pointwise and logit-scored by default: each row becomes a rubric (the conversation, the completion,
the gold answer when the template asks for it) ending in "Score:", and the judge's NEXT-TOKEN
probabilities over the score tokens "1".."K", renormalised, give reward = (E[k] - 1) / (K - 1)
(`algorithms.judge.expected_score`). One batched forward per `batch_size` rows, deterministic.
`mode="generate"` instead decodes a few tokens greedily and reads the reply strictly: a reply that
does not start with an integer in 1..K is an infra_error quoting it, never a silent 0.

Rendering, in the judge's OWN tokenizer (never the policy's `rendered_prompt`):
1. The conversation is the row's `messages` (a list of {role, content}) when present, else its
   `prompt` as one user message; it is written as "role: content" blocks separated by blank lines.
2. The template is filled: {conversation}, {completion}, {max_score}, and {answer}, which becomes
   "Reference answer: <gold>" and a blank line when the row has a gold `answer` and nothing when
   it has none (so one template serves rows with and without a gold answer).
3. With a chat template, the filled rubric is the user message of a one-message conversation,
   rendered with `add_generation_prompt=True`; without one, the rubric and a blank line. Either way
   the cue "Score:" follows, so the judge's reply starts right after it. The text is tokenised with
   no special tokens added (a chat template writes its own).
4. The score tokens are found in that context, once, at construction: "Score: 4" must be the
   prompt's tokens plus exactly one more, either with the prompt ending at "Score:" (tokenizers
   with " 4" as one token) or at "Score: " (tokenizers that write the space on its own, like
   SmolLM2's and the tiny model's); otherwise, or when two scores share an id, one UserError line.

Pairwise labelling (`JudgeVerifier.prefer`) shows both answers in both orders and reads the
next-token probability of "1" against "2" after "Better answer:" (`algorithms.judge.pairwise_preference`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from posttrain.algorithms.judge import expected_score, last_position_logits, pairwise_preference, score_probabilities
from posttrain.errors import UserError
from posttrain.hardware import Placement, cpu_placement
from posttrain.models.loading import load_model
from posttrain.rewards.base import Verifier
from posttrain.rewards.verdict import Verdict
from posttrain.rollout import SamplingConfig, generate

logger = logging.getLogger(__name__)

MODES = ("logits", "generate")
DEFAULT_MAX_SCORE = 5
DEFAULT_BATCH_SIZE = 16
SCORE_CUE = "Score:"
PAIR_CUE = "Better answer:"
DEFAULT_TEMPLATE = (
    "Rate the assistant's final answer from 1 (wrong or unhelpful) to {max_score} (correct and helpful). "
    "Reply with the number only.\n\n"
    "Conversation:\n{conversation}\n\n"
    "{answer}"
    "Assistant's answer:\n{completion}"
)
"""The pointwise rubric: {conversation}, {completion} and {max_score}; {answer} is the gold answer's
line (or nothing). The judge appends the cue "Score:" itself."""
PAIRWISE_TEMPLATE = (
    "Which answer is better, 1 or 2? Reply with 1 or 2 only.\n\n"
    "Conversation:\n{conversation}\n\n"
    "{answer}"
    "Answer 1:\n{answer_1}\n\n"
    "Answer 2:\n{answer_2}"
)
"""The pairwise rubric (`prefer`); the judge appends the cue "Better answer:"."""
TEMPLATE_FIELDS = ("conversation", "completion", "answer", "max_score")
REPLY = re.compile(r"\s*([0-9]+)\b(?![.,][0-9])")
"""A generated reply's score: an integer at its start (after spaces), not the start of a decimal."""
SPEC_OPTIONS: dict[str, Callable[[str], Any]] = {"mode": str, "max_score": int, "batch_size": int, "pass_threshold": float}
"""What `judge:MODEL,key=value,...` may set."""


@dataclasses.dataclass(frozen=True)
class ScoreTokens:
    """Where a judge's reply starts and which token ids its score labels are."""

    prompt_suffix: str
    """What every prompt ends with: the cue ("Score:") or the cue and a space."""
    labels: tuple[str, ...]
    """The scores as written: "1".."K"."""
    ids: tuple[int, ...]
    """(K,) the one token id of each label right after `prompt_suffix`."""


def parse_score(reply: str, max_score: int) -> int | None:
    """The score a generated reply starts with, or None when it does not start with an integer in
    1..max_score: parse_score(" 4.", 5) == 4; "great!", "9" (K = 5), "4.5" and "45" are None."""
    match = REPLY.match(reply)
    if not match:
        return None
    score = int(match.group(1))
    return score if 1 <= score <= max_score else None


def conversation_text(example: Mapping[str, Any]) -> str:
    """The conversation a row's completion answers, as "role: content" blocks: its `messages`, else
    its `prompt` as one user message. ValueError (a data_error) when it has neither."""
    messages = example.get("messages")
    if messages is None:
        prompt = example.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("the row has neither a prompt nor messages to judge against")
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("the row's messages must be a non-empty list of {role, content}")
    blocks = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"the row's messages must each be {{role, content}} strings, got {message!r:.80}")
        blocks.append(f"{message['role']}: {message['content']}")
    return "\n\n".join(blocks)


def reference_line(example: Mapping[str, Any]) -> str:
    """What {answer} becomes: the row's gold answer as a line and a blank line, or "" without one."""
    answer = example.get("answer")
    return "" if answer is None or answer == "" else f"Reference answer: {answer}\n\n"


def check_template(template: str, required: Sequence[str], allowed: Sequence[str], judge: str) -> None:
    """One UserError line unless `template` is a format string using every `required` field and
    only `allowed` ones, and leaves the cue to the judge."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as error:
        raise UserError(f"{judge}: cannot read the template ({error}); write a literal brace as {{{{ or }}}}") from None
    unknown = sorted(fields - set(allowed))
    missing = [name for name in required if name not in fields]
    if unknown or missing:
        raise UserError(f"{judge}: the template " + (f"has unknown fields {unknown}; " if unknown else "")
                        + (f"lacks {missing}; " if missing else "") + f"it may use {{{'}, {'.join(allowed)}}}")
    if template.rstrip().endswith(SCORE_CUE):
        raise UserError(f"{judge}: the template must not end with {SCORE_CUE!r}: the judge appends it")


def weights_sha256(model: torch.nn.Module) -> str:
    """sha256 over the state dict in name order: each tensor's name, shape, dtype and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`MODEL[,key=value...]` -> (MODEL, options): mode=logits|generate, max_score=K, batch_size=N.
    ValueError (one UserError line through `as_verifier`) for an empty model or an unknown option."""
    model, *parts = spec.split(",")
    if not model.strip():
        raise ValueError("judge:<model>: name the judge model, e.g. judge:smollm2-135m")
    options = {}
    for part in parts:
        key, separator, value = part.partition("=")
        if not separator or key.strip() not in SPEC_OPTIONS:
            raise ValueError(f"judge:{spec}: cannot read option {part!r}; options are mode=logits|generate, "
                             "max_score=K, batch_size=N, pass_threshold=X")
        try:
            options[key.strip()] = SPEC_OPTIONS[key.strip()](value.strip())
        except ValueError:
            raise ValueError(f"judge:{spec}: {key.strip()} must be a number, got {value!r}") from None
    return model.strip(), options


def judge_from_spec(spec: str, placement: Placement | None = None, batch_size: int = DEFAULT_BATCH_SIZE) -> "JudgeVerifier":
    """The verifier `judge:<spec>` names (`parse_spec`), on `placement`, `batch_size` rows per
    forward unless the spec sets its own."""
    model, options = parse_spec(spec)
    return JudgeVerifier(model, placement=placement, **{"batch_size": batch_size, **options})


class JudgeVerifier(Verifier):
    """A local LLM judge (see the module docstring), run in this process on `placement`'s device.

    Args:
        model: the judge's spec for `load_model` (its name on the run card).
        mode: "logits" (expected score over the score tokens) or "generate" (greedy reply, parsed).
        max_score: K, the top of the scale 1..K (>= 2; each score must be one token).
        template: the rubric with {conversation}, {completion}, optional {answer}, {max_score}.
        batch_size: rows per forward (or per generation call).
        pass_threshold: as a held-out checker, the reward at or above which a completion passes.
        placement: device and precision (default: the CPU in float32); the judge is loaded in its
            parameter dtype and runs under its autocast.
        loaded: an already loaded (model, tokenizer) to use instead of loading `model`.
    """

    in_worker = False

    def __init__(self, model: str, *, mode: str = "logits", max_score: int = DEFAULT_MAX_SCORE,
                 template: str | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
                 placement: Placement | None = None, loaded: tuple[Any, Any] | None = None, pass_threshold: float = 0.5):
        self.name = f"judge:{model}"
        if not 0 < pass_threshold <= 1:
            raise UserError(f"{self.name}: pass_threshold must be in (0, 1], got {pass_threshold!r}")
        self.pass_threshold = pass_threshold
        """As a held-out checker: a completion passes when its reward (E[k] - 1)/(K - 1) is at least
        this (0.5: the judge's expected score at the middle of its scale or above)."""
        if mode not in MODES:
            raise UserError(f"{self.name}: mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not isinstance(max_score, int) or max_score < 2:
            raise UserError(f"{self.name}: max_score must be an integer >= 2, got {max_score!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"{self.name}: batch_size must be an integer >= 1, got {batch_size!r}")
        self.template = DEFAULT_TEMPLATE if template is None else template
        check_template(self.template, ("conversation", "completion"), TEMPLATE_FIELDS, self.name)
        self.model_spec, self.mode, self.max_score, self.batch_size = model, mode, max_score, batch_size
        self.placement = placement or cpu_placement()
        if loaded is None:
            try:
                loaded = load_model(model, dtype=self.placement.param_dtype, device=self.placement.device)
            except UserError as error:  # "model 'x': ..." alone does not say which model: this is the judge
                reason = str(error).removeprefix(f"model {model!r}: ")
                raise UserError(f"{self.name}: the judge model {model!r}: {reason}") from None
        self.model, self.tokenizer = loaded
        self.model.eval()
        self.device = next(self.model.parameters()).device
        self.context_length = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        self.reply_tokens = len(str(max_score)) + 2
        """generate mode: enough tokens to write the largest score and see that the number ended"""
        self.score_tokens = self.resolve_tokens(SCORE_CUE, [str(k) for k in range(1, max_score + 1)])
        logger.info("%s: scores 1..%d are tokens %s after %r", self.name, max_score,
                    list(self.score_tokens.ids), self.score_tokens.prompt_suffix)

    # --- rendering ----------------------------------------------------------------------------
    def render(self, rubric: str, suffix: str) -> str:
        """The judge's prompt text: the rubric as the one user message of its chat template (with the
        generation prompt), else the rubric and a blank line; then `suffix` (the cue)."""
        if getattr(self.tokenizer, "chat_template", None):
            head = self.tokenizer.apply_chat_template([{"role": "user", "content": rubric}], tokenize=False,
                                                      add_generation_prompt=True)
        else:
            head = rubric + "\n\n"
        return head + suffix

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def resolve_tokens(self, cue: str, labels: Sequence[str]) -> ScoreTokens:
        """The single token of each label right after `cue` in a rendered prompt (module docstring,
        rule 4); one UserError line naming the judge and the first label that is not one token."""
        furthest = (-1, "")
        for suffix, lead in ((cue, " "), (cue + " ", "")):
            probe = self.render("?", suffix)
            base = self.encode(probe)
            ids = []
            for label in labels:
                full = self.encode(probe + lead + label)
                if len(full) != len(base) + 1 or full[:len(base)] != base:
                    pieces = self.tokenizer.convert_ids_to_tokens(full[len(base):] if full[:len(base)] == base
                                                                  else self.encode(lead + label))
                    problem = (f"the score {label!r} is not one token for the judge's tokenizer (after {suffix!r} "
                               f"it is {pieces}); every score {labels[0]}..{labels[-1]} must be one token: "
                               "use a smaller max_score or another judge")
                    break
                ids.append(full[-1])
            else:
                if len(set(ids)) == len(ids):
                    return ScoreTokens(suffix, tuple(labels), tuple(ids))
                twins = [label for label, i in zip(labels, ids) if ids.count(i) > 1]
                problem = f"the scores {twins} are the same token for the judge's tokenizer"
            if len(ids) >= furthest[0]:
                furthest = (len(ids), problem)
        raise UserError(f"{self.name}: {furthest[1]}")

    @functools.cached_property
    def pair_tokens(self) -> ScoreTokens:
        """The tokens "1" and "2" after "Better answer:" (`prefer`), resolved on first use."""
        return self.resolve_tokens(PAIR_CUE, ["1", "2"])

    def rubric(self, completion: str, example: Mapping[str, Any]) -> str:
        """The filled pointwise template for one row; ValueError when the row cannot be rendered."""
        return self.template.format(conversation=conversation_text(example), completion=completion,
                                    answer=reference_line(example), max_score=self.max_score)

    # --- the judge's forward ------------------------------------------------------------------
    @torch.no_grad()
    def next_token_logits(self, prompts: Sequence[Sequence[int]], token_ids: Sequence[int]) -> torch.Tensor:
        """(N, K) float32 next-token logits of `token_ids` after each prompt (N lists of ids), on the
        CPU: one forward per `batch_size` rows, left-padded, positions counting real tokens only,
        each row read at its last attended position."""
        forward = getattr(self.model, "get_base_model", lambda: self.model)().forward
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(forward).parameters else {}
        columns = torch.tensor(list(token_ids), device=self.device)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        chunks = []
        for start in range(0, len(prompts), self.batch_size):
            rows = prompts[start:start + self.batch_size]
            width = max(len(row) for row in rows)
            input_ids = torch.tensor([[pad] * (width - len(row)) + list(row) for row in rows], device=self.device)
            attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=self.device)
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # a padded row's positions = its unpadded ones
            with self.placement.autocast():
                logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False, **keep).logits  # (n, 1 or width, V)
            chunks.append(last_position_logits(logits, attention_mask)[:, columns].float())  # (n, K)
        return torch.cat(chunks).cpu()

    def replies(self, prompts: Sequence[Sequence[int]]) -> list[str]:
        """Greedy replies of at most `reply_tokens` tokens after each prompt (generate mode)."""
        sampling = SamplingConfig(greedy=True, max_new_tokens=self.reply_tokens)
        with self.placement.autocast():
            rollout = generate(self.model, self.tokenizer, [list(p) for p in prompts], sampling=sampling,
                               max_batch_size=self.batch_size)
        return list(rollout.texts)

    # --- the Verifier -------------------------------------------------------------------------
    def batch(self, completions: Sequence[str], examples: Sequence[Mapping[str, Any]],
              workers: int | None = None) -> list[Verdict]:
        """Judge completions[i] against examples[i], in batches of `batch_size` (`workers` unused)."""
        if len(completions) != len(examples):
            raise ValueError(f"{len(completions)} completions but {len(examples)} examples")
        verdicts: list[Verdict | None] = [None] * len(completions)
        prompts, rows = [], []
        budget = (self.context_length or 0) - (self.reply_tokens if self.mode == "generate" else 0)
        for index, (completion, example) in enumerate(zip(completions, examples)):
            if not isinstance(completion, str):
                verdicts[index] = Verdict.data_error(f"completion must be a string, got {type(completion).__name__}")
                continue
            if not isinstance(example, Mapping):
                verdicts[index] = Verdict.data_error(f"example must be a mapping, got {type(example).__name__}")
                continue
            try:
                text = self.render(self.rubric(completion, example), self.score_tokens.prompt_suffix)
            except ValueError as error:
                verdicts[index] = Verdict.data_error(f"{self.name}: {error}")
                continue
            ids = self.encode(text)
            if self.context_length and len(ids) > budget:
                verdicts[index] = Verdict.infra_error(
                    f"{self.name}: the rubric is {len(ids)} tokens, past the judge's context of {self.context_length}")
                continue
            prompts.append(ids)
            rows.append(index)
        if prompts:
            scored = self._judge_logits(prompts) if self.mode == "logits" else self._judge_replies(prompts)
            for index, verdict in zip(rows, scored):
                verdicts[index] = verdict
        return verdicts

    def _judge_logits(self, prompts: Sequence[Sequence[int]]) -> list[Verdict]:
        logits = self.next_token_logits(prompts, self.score_tokens.ids)  # (n, K)
        rewards, probabilities = expected_score(logits).tolist(), score_probabilities(logits).tolist()
        K = self.max_score
        return [Verdict.ok(reward, f"judge's expected score {1 + reward * (K - 1):.2f} of {K}",
                           probabilities=row, expected_score=1 + reward * (K - 1))
                for reward, row in zip(rewards, probabilities)]

    def _judge_replies(self, prompts: Sequence[Sequence[int]]) -> list[Verdict]:
        verdicts = []
        for reply in self.replies(prompts):
            score = parse_score(reply, self.max_score)
            if score is None:
                verdicts.append(Verdict.infra_error(
                    f"{self.name}: the judge's reply {reply!r} is not a score 1..{self.max_score}", reply=reply))
            else:
                verdicts.append(Verdict.ok((score - 1) / (self.max_score - 1),
                                           f"judge scored {score} of {self.max_score}", reply=reply, score=score))
        return verdicts

    def score(self, completion: str, example: Mapping[str, Any]) -> Verdict:
        """One row (see `batch`)."""
        return self.batch([completion], [example])[0]

    def prefer(self, prompt_rows: Sequence[Mapping[str, Any]], answers_a: Sequence[str],
               answers_b: Sequence[str]) -> list[dict[str, Any]]:
        """Pairwise labels: per row {p: P(A > B), p_ab, p_ba, position_bias} from both presentation
        orders (`algorithms.judge.pairwise_preference`); a row that cannot be rendered gets None for
        each and a `reason`. One forward per `batch_size` prompts (2 per row)."""
        if not len(prompt_rows) == len(answers_a) == len(answers_b):
            raise ValueError(f"{len(prompt_rows)} rows, {len(answers_a)} answers A, {len(answers_b)} answers B")
        tokens = self.pair_tokens
        results: list[dict[str, Any] | None] = [None] * len(prompt_rows)
        first, second, rows = [], [], []
        for index, (row, a, b) in enumerate(zip(prompt_rows, answers_a, answers_b)):
            try:
                conversation, reference = conversation_text(row), reference_line(row)
            except ValueError as error:
                results[index] = {"p": None, "p_ab": None, "p_ba": None, "position_bias": None, "reason": str(error)}
                continue
            for prompts, (one, two) in ((first, (a, b)), (second, (b, a))):
                rubric = PAIRWISE_TEMPLATE.format(conversation=conversation, answer=reference, answer_1=one, answer_2=two)
                prompts.append(self.encode(self.render(rubric, tokens.prompt_suffix)))
            rows.append(index)
        if rows:
            first_wins = score_probabilities(self.next_token_logits(first + second, tokens.ids))[:, 0]  # (2n,)
            p_ab, p_ba = first_wins[:len(rows)], first_wins[len(rows):]
            p, bias = pairwise_preference(p_ab, p_ba)
            for index, values in zip(rows, zip(p.tolist(), p_ab.tolist(), p_ba.tolist(), bias.tolist())):
                results[index] = dict(zip(("p", "p_ab", "p_ba", "position_bias"), values))
        return results

    # --- identity -----------------------------------------------------------------------------
    @functools.cached_property
    def weights_hash(self) -> str:
        """sha256 of the judge's weights (`weights_sha256`), computed once."""
        return weights_sha256(self.model)

    def implementation(self) -> dict[str, str]:
        """The judge's weights: two judges with the same weights are not independent checks, whatever
        their template."""
        return {"judge": f"weights sha256:{self.weights_hash}"}

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name, "model": self.model_spec, "mode": self.mode, "max_score": self.max_score,
                "template_sha256": hashlib.sha256(self.template.encode()).hexdigest()[:16],
                "prompt_suffix": self.score_tokens.prompt_suffix, "score_token_ids": list(self.score_tokens.ids),
                "chat_template": bool(getattr(self.tokenizer, "chat_template", None)),
                "batch_size": self.batch_size, "device": str(self.device), "pass_threshold": self.pass_threshold}
