"""Data: prompt tasks, preference pairs, chat templates, the canonical masks, and validation.

Public API (signatures are the contract other modules rely on):

Tokenisation (posttrain.data.tokenize)
    tokenize_prompt_response(tokenizer, prompts: Sequence[str | list[dict]], responses: Sequence[str], *,
        truncation: TruncationPolicy | None = None, padding_side: "right" | "left" = "right",
        add_eos: bool = True, system_prompt: str | None = None, use_chat_template: bool | None = None)
        -> TokenizedBatch
        TokenizedBatch fields: input_ids (N, L) long; attention_mask (N, L) long 1/0;
        mask (N, L) bool, True = response token incl. the ending EOS, prompt/padding False;
        prompt_lengths (N,) long; response_lengths (N,) long; kept: list[int] (input index of each
        row); counts: TruncationCounts(prompts_truncated, responses_truncated, dropped).
        The log-prob of token t comes from logits[:, t-1]: use mask[:, 1:] with labels input_ids[:, 1:].
    tokenize_prompts(tokenizer, prompts, *, truncation=None, padding_side="left", system_prompt=None,
        use_chat_template=None) -> TokenizedBatch            # prompts only, mask all False
    collate_token_ids(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], *,
        pad_token_id: int, padding_side="right") -> TokenizedBatch   # for ids a sampler produced
    render_prompt(tokenizer, prompt, *, system_prompt=None, use_chat_template=None) -> str
        chat template when the tokenizer has one (a string prompt becomes one user message), else plain.
    encode_prompt(tokenizer, prompt, *, system_prompt=None, use_chat_template=None) -> list[int]
    encode_response(tokenizer, response: str, *, add_eos=True) -> list[int]
    TruncationPolicy(max_prompt_tokens=None, max_response_tokens=None,
        prompt: "error" | "left" | "drop" = "error", response: "right" | "drop" | "error" = "right")
    position_ids_from_attention_mask(attention_mask (N, L)) -> (N, L) long

Prompt tasks (posttrain.data.tasks, .examples, .prompts)
    Example(id, prompt=None, messages=None, answer=None, tests=None, entry_point=None, metadata={})
        .prompt_input -> str | list[dict] (what render_prompt takes). reasoning-gym rows carry
        metadata["rg_dataset"], ["rg_options"], ["entry"]; HumanEval rows carry tests=[check source],
        entry_point and metadata["canonical_solution"].
    Task(name, split, examples, reward_kind: "number" | "math" | "text" | "choice" | "reasoning_gym" | "code" | "mbpp" | "stdio",
        rows_bad, duplicates_removed, options)
    load_task(spec, *, size=None, seed=0, split="all", options=None, strict=True, tokenizer=None,
        max_prompt_tokens=None, system_prompt=None) -> Task
        spec: "arithmetic" (options digits=2, operation="add"|"sub"|"mul") | "rg:<dataset>" (options:
        the dataset's config) | "humaneval" | a data file, save_to_disk directory or cached dataset name
        (options answer_format, format, columns, split, strict).
    load_splits(spec, *, train_size=None, eval_size, seed=0, **load_task_options) -> (train, held_out)
        disjoint by construction and checked; the held-out split depends only on (spec, seed, eval_size);
        eval_size None: 200, or one in ten of a file under 2,000 rows (tasks.default_eval_size).
    score_reasoning_gym(example, answer: str | None) -> float    # the dataset's own scorer, 0..1
    load_prompt_file(path, *, strict=True, answer_format="math", tokenizer=None, max_prompt_tokens=None,
        system_prompt=None, use_chat_template=None) -> Task
    remove_overlap(train, held_out) -> int;  require_examples(task, batch_size=1) -> None

Preference pairs (posttrain.data.preference)
    PreferencePair(id, prompt: str | list[dict], chosen: str, rejected: str, metadata={})
    load_preference_file(path, *, strict=True, system_prompt=None, tokenizer=None, max_prompt_tokens=None,
        use_chat_template=None, data_format=None, columns=None, source_split=None)
        -> PreferenceData(source, pairs, rows_bad, system_prompt); path: any source data.files reads
    tokenize_preference_pairs(tokenizer, pairs, *, truncation=None, padding_side="right",
        system_prompt=None, use_chat_template=None) -> PreferenceBatch(chosen, rejected, kept, counts)
        chosen and rejected are TokenizedBatches padded to the same L.
    load_pairs(path, tokenizer, *, heldout_file, heldout_pairs, split_seed, strict, truncation,
        system_prompt, use_chat_template, data_format, columns, source_split) -> PairSplits(train, heldout, stats)
        a pairs file split by prompt (no prompt on both sides), or a separate held-out file.
    split_pairs(pairs, count, seed) -> (train, held_out);  prompt_key(prompt) -> str
    pair_up(texts, verdicts, threshold, limit) -> ([(chosen, rejected)], outcome)   # posttrain.data.pairing:
        one prompt's scored answers, what `posttrain pairs` writes

Online batches and code screening (posttrain.data.scored_batch, .screening)
    sample_and_score(policy, tokenizer, stream, verifier, *, prompts, group_size, sampling, seed, step, timer,
        system_prompt=None, refill_rounds=None, world=None, sampler=single_turn, truncated="score", version=None)
        -> ScoredBatch(rollout, examples, rendered, scores, owners, stats, version, serves)   # B x G rows, DAPO refills
    PendingBatches(max_staleness).next(step, last_step, draw) -> ScoredBatch   # (.staleness) batches sampled ahead
    screen_problems(train, held_out, judge, *, preflight=True, exclude_weak_tests=False, workers=None)
        -> dict | None   # the run card's record; problems removed in place

Provenance and order (posttrain.data.provenance, .stream: one epoch stream, two seedings)
    provenance_path(path) -> Path (pairs.jsonl -> pairs.meta.json); read_provenance(path) -> dict | None;
    write_with_provenance(out, rows, provenance) (atomic, with the file's SHA-256); file_sha256(path)
    data_order(num_examples, seed, position, count) -> list[int]   # SFT / DPO rows, seeded epochs
    PromptStream(task, seed, position=0).take(count) -> list[Example]  # the online recipes' prompts

Sources (posttrain.data.source)
    TaskSource(task="arithmetic", task_options={}, format=None, columns={}, split=None, eval_size=None,
        system_prompt=None, strict=True): the settings every recipe's data section extends (online, SFT, pairs);
        .load_options() -> dict (what load_splits takes, strict: false included); .validate(prefix="data.") (its `sizes` at
        least 1, a known format and columns)

Validation (posttrain.data.validation)
    ValidationReport(source, rows_read, problems: list[BadRow], hint); .lines() -> ["FILE:LINE: field: reason"];
    .rows_bad; .enforce(strict, setting="data.strict") raises UserError listing the first 5 problems,
    how many more and the layout hint when strict.
    validate_prompt_file(path, **checks) / validate_preference_file(path, **checks)
        -> (list[(line, item)], ValidationReport)       # what `posttrain data check` runs
"""

from posttrain.data.examples import Example, Task, check_disjoint, derived_seed, remove_overlap, require_examples
from posttrain.data.pair_batch import PreferenceBatch, tokenize_preference_pairs
from posttrain.data.preference import PreferenceData, PreferencePair, load_preference_file, validate_preference_file
from posttrain.data.prompts import load_prompt_file, validate_prompt_file
from posttrain.data.tasks import humaneval_examples, load_splits, load_task, score_reasoning_gym
from posttrain.data.tokenize import (
    Prompt,
    TokenizedBatch,
    TruncationCounts,
    TruncationPolicy,
    apply_truncation,
    collate_token_ids,
    encode_prompt,
    encode_response,
    has_chat_template,
    position_ids_from_attention_mask,
    render_prompt,
    tokenize_prompt_response,
    tokenize_prompts,
)
from posttrain.data.validation import BadRow, ValidationReport

__all__ = [
    "BadRow",
    "Example",
    "PreferenceBatch",
    "PreferenceData",
    "PreferencePair",
    "Prompt",
    "Task",
    "TokenizedBatch",
    "TruncationCounts",
    "TruncationPolicy",
    "ValidationReport",
    "apply_truncation",
    "check_disjoint",
    "collate_token_ids",
    "derived_seed",
    "encode_prompt",
    "encode_response",
    "has_chat_template",
    "humaneval_examples",
    "load_preference_file",
    "load_prompt_file",
    "load_splits",
    "load_task",
    "position_ids_from_attention_mask",
    "remove_overlap",
    "render_prompt",
    "require_examples",
    "score_reasoning_gym",
    "tokenize_preference_pairs",
    "tokenize_prompt_response",
    "tokenize_prompts",
    "validate_preference_file",
    "validate_prompt_file",
]
