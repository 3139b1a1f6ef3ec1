"""SFT on users' rows: prompt/completion pairs and chat conversations (TRL's SFT layouts), read like
every data file (`posttrain.data.files`) and tokenised with the loss on the tokens `loss_on` names.

Row layouts (after the column mapping):

    {"prompt": "2+2=", "completion": "4"}                         standard prompt / completion
    {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}   conversational
    {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}         a conversation

`loss_on`:
* `assistant` (default): every assistant turn of a conversation (each turn's content and the
  end-of-turn token the template writes after it, not the template's own role headers); for
  prompt / completion rows, the completion;
* `completion`: the completion, or a conversation's last assistant turn only;
* `all`: every real token (prompt included).

The masks come from character spans of the rendered chat text: turn i's span is what
`apply_chat_template(messages[: i + 1])` adds after `apply_chat_template(messages[: i],
add_generation_prompt=True)`, trailing whitespace excluded, and a token counts when its first
character lies in a span (a fast tokenizer's offsets). A template whose rendering of a prefix of the
conversation is not a prefix of the whole rendering (templates that rewrite earlier turns) is
refused with one line.

The SFT data link itself lives here too: `Data`, the run's data section (a `TaskSource`), and
`load_data(data, seed, tokenizer) -> SFTData`, a task's gold answers or a file's SFT rows, split and
ready to encode (`posttrain.recipes.sft` runs it).
"""

from __future__ import annotations

import random
from array import array

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch

from posttrain.data.examples import Task, derived_seed
from posttrain.data.files import RowTable, RowView, check_columns, is_data_source, map_row, read_rows, resolve_columns
from posttrain.data.provenance import read_provenance, rows_card
from posttrain.data.source import TaskSource
from posttrain.data.tasks import default_eval_size, heldout_size_from, load_splits
from posttrain.data.tokenize import TokenizedBatch, has_chat_template, tokenize_prompt_response, with_tools
from posttrain.data.validation import ValidationReport, check_messages, check_prompt_length, check_text, type_name
from posttrain.errors import UserError
from posttrain.rewards import Verifier

LOSS_ON = ("assistant", "completion", "all")


@dataclass
class SFTRow:
    """One training row: a prompt and completion string, or a conversation whose messages from
    `train_from` on may carry the loss (the completion's, for a conversational prompt / completion
    row; 0 for a whole conversation)."""

    id: str
    prompt: str | None = None
    completion: str | None = None
    messages: list[dict] | None = None
    train_from: int = 0
    metadata: dict = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def is_sft_file(path: str, data_format: str | None = None, columns: dict | None = None, split: str | None = None) -> bool:
    """True when the file's (mapped) first row has `messages` or `completion`: SFT rows, not a task."""
    mapping = resolve_columns(data_format, columns)
    report = ValidationReport(str(path))
    for _, row in read_rows(path, report, split):
        row = map_row(row, mapping)
        return "completion" in row or ("messages" in row and "answer" not in row and "tests" not in row)
    return False


def load_sft_rows(path: str | Path, *, data_format: str | None = None, columns: dict | None = None,
                  source_split: str | None = None, strict: bool = True, allow_empty: bool = False, tokenizer=None,
                  max_prompt_tokens: int | None = None, system_prompt: str | None = None) -> tuple[RowView, ValidationReport]:
    """Every valid row of an SFT file, and the report of the others (a UserError listing them when
    `strict`, as for every data file; an empty result is a UserError unless `allow_empty`). The rows
    are a `RowView`: handles into the file, each row parsed again when read, so a large file is not
    held as Python objects. tokenizer + max_prompt_tokens: also report a row whose prompt (the
    messages before its first trained turn, chat template applied) is longer than the limit."""
    mapping = resolve_columns(data_format, columns)
    table = RowTable(path, source_split)
    check_columns(str(path), table.columns, mapping)
    report = ValidationReport(str(path))
    parse = _SFTParser(str(path), mapping)

    handles, numbers = array("q"), array("q")
    for handle, line, row in table.scan(report):
        parsed = parse(line, row, report)  # checked, then dropped
        prompt = sft_prompt(parsed) if parsed is not None else None
        if parsed is not None and (not prompt or check_prompt_length(report, line, prompt, tokenizer, max_prompt_tokens,
                                                                     system_prompt=system_prompt)):
            handles.append(handle)
            numbers.append(line)
    if not allow_empty:  # allow_empty: a check that reports every row (posttrain data check), no enforcing
        report.enforce(strict)
    if not handles and not allow_empty:
        raise UserError(f"{path}: no usable SFT rows")
    return RowView(table, handles, numbers, parse), report


@dataclass
class _SFTParser:
    """One row of an SFT file as its SFTRow (a picklable `RowView.parse`)."""

    source: str
    mapping: dict

    def __post_init__(self):
        self.file_name = Path(self.source).name

    def __call__(self, line: int, row: dict, into: ValidationReport | None = None) -> SFTRow | None:
        return parse_sft_row(into or ValidationReport(self.source), line, map_row(row, self.mapping), self.file_name)


def parse_sft_row(report: ValidationReport, line: int, row: dict, file_name: str) -> SFTRow | None:
    row_id = str(row.get("id", f"{file_name}:{line}"))
    extra = {k: v for k, v in row.items() if k not in ("prompt", "completion", "messages", "id")}
    if "messages" in row:
        if not check_messages(report, line, "messages", row["messages"]):
            return None
        if not any(m["role"] == "assistant" for m in row["messages"]):
            report.add(line, "messages", "no assistant message to train on")
            return None
        return SFTRow(row_id, messages=list(row["messages"]), metadata=extra)
    if "prompt" not in row or "completion" not in row:
        report.add(line, "completion" if "prompt" in row else "prompt",
                   "missing field (an SFT row has `messages`, or `prompt` and `completion`)")
        return None
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        ok = check_text(report, line, "prompt", prompt)
        ok = check_text(report, line, "completion", completion) and ok
        return SFTRow(row_id, prompt=prompt, completion=completion, metadata=extra) if ok else None
    if isinstance(prompt, list) and isinstance(completion, list):
        ok = check_messages(report, line, "prompt", prompt)
        ok = check_messages(report, line, "completion", completion) and ok
        if ok and not any(m["role"] == "assistant" for m in completion):
            report.add(line, "completion", "no assistant message to train on")
            ok = False
        return SFTRow(row_id, messages=list(prompt) + list(completion), train_from=len(prompt), metadata=extra) if ok else None
    report.add(line, "completion", f"prompt and completion must both be strings or both message lists, got "
                                   f"{type_name(prompt)} and {type_name(completion)}")
    return None


def sft_prompt(row: SFTRow):
    """What a row's model sees before the first token it is trained on: a string row's prompt, or
    the messages before a conversation's first trained assistant turn (empty when it opens with one)."""
    if not row.is_chat:
        return row.prompt
    first = next(i for i, m in enumerate(row.messages) if m["role"] == "assistant" and i >= row.train_from)
    return row.messages[:first]


def chat_token_mask(tokenizer, messages: list[dict], loss_on: str = "assistant", train_from: int = 0,
                    tools: list[dict] | None = None) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it carries the loss. A tool
    transcript (assistant `tool_calls`, `tool` messages) trains on the assistant turns, calls
    included, never on the tools' results; `tools` (JSON schemas) go to the template's tools=."""
    if not has_chat_template(tokenizer):
        raise UserError("chat SFT rows need a tokenizer with a chat template (this model has none); "
                        "use prompt/completion string rows")
    for index, message in enumerate(messages):
        if message.get("tool_calls"):
            bare = {key: value for key, value in message.items() if key != "tool_calls"}
            if (tokenizer.apply_chat_template(messages[:index] + [message], tokenize=False)
                    == tokenizer.apply_chat_template(messages[:index] + [bare], tokenize=False)):
                raise UserError(f"this chat template does not render an assistant message's tool_calls ({tokenizer.name_or_path}: "
                                "a model saved with an older template?); the calls would be trained as an empty turn. Use a template "
                                "that writes them, or write each call in the message's content as <tool_call>{...}</tool_call>")
            break
    told, extra = with_tools(tokenizer, messages, tools)  # told of the tools as the prompts of tool episodes are
    train_from += len(told) - len(messages)  # a system message that describes them may come first
    messages = told
    text = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= train_from]
    if loss_on == "completion":
        assistant = assistant[-1:]
    spans = []
    for i in assistant:
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True, **extra) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False, **extra)
        if not (text.startswith(through) and through.startswith(before)):
            raise UserError("this chat template renders earlier turns differently once later ones follow; "
                            "train on prompt/completion rows (or loss_on: all) instead")
        turn = through[len(before):]
        spans.append((len(before), len(before) + len(turn.rstrip())))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if loss_on == "all":
        return ids, [True] * len(ids)
    mask = [any(start <= first < end for start, end in spans) for first, _ in encoded["offset_mapping"]]
    return ids, mask


def tokenize_sft(tokenizer, rows: list[SFTRow], *, loss_on: str = "assistant", system_prompt: str | None = None,
                 tools: list[dict] | None = None) -> TokenizedBatch:
    """A right-padded `TokenizedBatch` of SFT rows with the loss mask `loss_on` asks for (module doc).
    `tools`: the JSON schemas every conversation is rendered with (a row's own `tools` field wins).
    prompt_lengths: tokens before the first loss token of each row."""
    if loss_on not in LOSS_ON:
        raise UserError(f"sft loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pieces: list[tuple[list[int], list[bool]]] = []
    for row in rows:
        if row.is_chat:
            messages = row.messages
            offset = 0
            if system_prompt and messages[0]["role"] != "system":
                messages, offset = [{"role": "system", "content": system_prompt}] + messages, 1
            pieces.append(chat_token_mask(tokenizer, messages, loss_on, row.train_from + offset,
                                          tools=row.metadata.get("tools") or tools))
        else:
            batch = tokenize_prompt_response(tokenizer, [row.prompt], [row.completion], system_prompt=system_prompt)
            length = int(batch.attention_mask[0].sum())
            ids = batch.input_ids[0, :length].tolist()
            mask = [True] * length if loss_on == "all" else batch.mask[0, :length].tolist()
            pieces.append((ids, mask))
    width = max(len(ids) for ids, _ in pieces)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for index, (ids, loss) in enumerate(pieces):
        input_ids[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[index, : len(ids)] = 1
        mask[index, : len(ids)] = torch.tensor(loss, dtype=torch.bool)
    first = [loss.index(True) if True in loss else len(loss) for _, loss in pieces]
    return TokenizedBatch(input_ids=input_ids, attention_mask=attention_mask, mask=mask,
                          prompt_lengths=torch.tensor(first, dtype=torch.long),
                          response_lengths=mask.sum(-1), kept=list(range(len(rows))))


@dataclass
class Data(TaskSource):
    """Link 1, data: the task or file to imitate, how its columns map, and the held-out split (the
    shared `TaskSource`), with SFT's own loss mask, response template and training size."""

    sizes: ClassVar[tuple[str, ...]] = ("train_size", "eval_size")

    task: str = "arithmetic"
    """Task spec: arithmetic | rg:<dataset> | a data file of prompts with answers | a data file of SFT rows (messages, or prompt + completion; docs/data.md)."""
    loss_on: str = "assistant"
    """SFT rows: assistant (every assistant turn; a prompt/completion row's completion) | completion (the last assistant turn) | all (every token)."""
    response_template: str = "<answer>{answer}</answer>"
    """How a gold answer becomes the training response."""
    eval_size: int | None = None
    """Held-out rows or problems, disjoint from training (a seeded draw); None: 200, or one in ten of a file under 2,000 rows (logged; the run card records it)."""
    train_size: int | None = None
    """Training examples; None: 20000 for a generated task (arithmetic, rg:), every row not held out for a file (more than it has is refused)."""
    tools: list[str] = field(default_factory=list)
    """SFT rows that are tool transcripts: the tools whose schemas the chat template renders (`tools.names` of an online run: python, calculator, add, module:function); a row's own `tools` field (JSON schemas) wins."""

    def validate(self) -> None:
        super().validate()
        if "{answer}" not in self.response_template:
            raise UserError("data.response_template must contain {answer}")
        if self.loss_on not in LOSS_ON:
            raise UserError(f"data.loss_on must be one of {', '.join(LOSS_ON)}, got {self.loss_on!r}")


@dataclass
class SFTData:
    """What a run imitates: a task's gold answers written into `response_template` (held-out
    accuracy can then be measured), or a file's SFT rows (held-out NLL only). `encode` turns items
    (Examples or SFTRows) into a `TokenizedBatch`."""

    train: list
    held_out: list
    encode: Callable[[list], TokenizedBatch]
    task: Task | None
    """The held-out task scored by pass@1: the gold-answer form's, or for SFT rows the task their
    provenance (or acceptance.task) names (`recipes/sft.rows_acceptance`); None: held-out NLL only."""
    card: dict
    checker: Verifier | None = None
    """The held-out checker of `task` (built once, with the run's reward_options)."""
    shifted: list = field(default_factory=list)
    """The shifted held-out sets (`HeldOutSet`s) beside `task`."""

    @property
    def rows_file(self) -> bool:
        """Whether the run imitates a file's SFT rows (else a task's gold answers)."""
        return self.card.get("kind") == "SFT rows"


def load_data(data: Data, seed: int, tokenizer) -> SFTData:
    """The run's data, checked before anything is written (one UserError line on bad input): a
    file of SFT rows (`_load_rows`) or a task's gold answers (`_load_task`). `encode` of n items
    gives an (n, L) right-padded `TokenizedBatch`."""
    options = data.load_options()
    if is_data_source(data.task) and is_sft_file(data.task, data.format, data.columns or None, data.split):
        return _load_rows(data, seed, tokenizer, options)
    return _load_task(data, seed, tokenizer, options)


def _load_rows(data: Data, seed: int, tokenizer, options: dict) -> SFTData:
    """A file's SFT rows: a seeded held-out draw of eval_size rows (None: `default_eval_size`), the
    next train_size (None: all the others) for training."""
    rows, report = load_sft_rows(data.task, data_format=data.format, columns=data.columns or None, source_split=data.split,
                                 strict=data.strict)
    order = list(range(len(rows)))  # the rows stay in the file; shuffled as positions
    random.Random(derived_seed(seed, "split")).shuffle(order)
    eval_size = default_eval_size(len(order), data.task) if data.eval_size is None else data.eval_size
    if eval_size >= len(order):
        raise UserError(f"data.task {data.task}: eval_size={eval_size} leaves no training rows out of {len(order)}")
    if data.train_size is not None and eval_size + data.train_size > len(order):
        raise UserError(f"data.task {data.task}: train_size={data.train_size} + eval_size={eval_size} is more than its "
                        f"{len(order)} rows")
    end = None if data.train_size is None else eval_size + data.train_size
    held, train = rows.take(order[:eval_size]), rows.take(order[eval_size:end])

    schemas = None
    if data.tools:
        from posttrain.rollout.tools import tool_schemas  # the schemas only: nothing is started

        schemas = tool_schemas(data.tools)

    def encode(items):
        return tokenize_sft(tokenizer, items, loss_on=data.loss_on, system_prompt=data.system_prompt, tools=schemas)

    encode([*train[:1], *held[:1]])  # a template that cannot mask fails here, before the run directory exists
    chats = sum(row.is_chat for row in train)
    card = {"task": data.task, "options": options, "kind": "SFT rows", "train_rows": len(train), "heldout_rows": len(held),
            "heldout_size_from": heldout_size_from(data.eval_size), "conversations": chats,
            "prompt_completion_rows": len(train) - chats, "loss_on": data.loss_on,
            **report.dropped(),
            "tool_transcripts": sum(any(m["role"] == "tool" for m in row.messages) for row in train if row.is_chat),
            **({"tools": list(data.tools)} if data.tools else {})}
    provenance = rows_card(data.task, read_provenance(data.task)) if Path(data.task).is_file() else None
    if provenance:  # a `posttrain pairs --sft` file (or any file with a sidecar): where its rows came from
        card["provenance"] = provenance
    return SFTData(train, held, encode, None, card)


def _load_task(data: Data, seed: int, tokenizer, options: dict) -> SFTData:
    """A task's examples, each gold answer written into `response_template` as the response."""
    train, held_out = load_splits(data.task, train_size=data.train_size, eval_size=data.eval_size, seed=seed, options=options)
    missing = [e.id for e in train.examples if e.answer is None]
    if missing:
        raise UserError(f"data.task {data.task}: example {missing[0]} has no answer to train on")
    if data.loss_on == "all":
        raise UserError("data.loss_on all applies to SFT rows (messages, prompt + completion); a task's gold answers train the response only")

    def encode(examples):
        return tokenize_prompt_response(tokenizer, [e.prompt_input for e in examples],
                                        [data.response_template.format(answer=e.answer) for e in examples],
                                        system_prompt=data.system_prompt)

    card = {"task": data.task, "options": options, "train_examples": len(train), "heldout_examples": len(held_out),
            "heldout_size_from": heldout_size_from(data.eval_size), "rows_bad": train.rows_bad,
            "rows_bad_reasons": train.rows_bad_reasons,
            "duplicates_removed": train.duplicates_removed, "response_template": data.response_template}
    return SFTData(train.examples, held_out.examples, encode, held_out, card)
