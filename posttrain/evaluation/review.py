"""A human spot check of the acceptance checker, with measured agreement (`posttrain review`).

A seeded sample of a run's held-out rows (one eval file's `rows`: id, prompt, gold, completion,
extracted, reward, status, reason: `evaluation/heldout_rows.py`) goes on one self-contained HTML
sheet, the gold answer and the answer the checker read beside each completion; a person marks each
checker verdict agree | disagree | unsure and saves `marks.json`:

    [{"id": "arithmetic-eval-3", "verdict": "incorrect", "mark": "agree"}, ...]

Agreement is agreed / (agreed + disagreed) with its 95% Wilson interval; unsure and unmarked rows
are left out of it and counted. Everything here is a pure function of rows and marks; the command
(`commands/review.py`) reads and writes the files.
"""

from __future__ import annotations

import html
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from posttrain.errors import UserError
from posttrain.evaluation.stats import wilson_interval

MARKS = ("agree", "disagree", "unsure")
# grpo / ppo / sft write eval/step-NNNNNN.json; dpo writes eval/task-step-NNNNNN.json.
EVAL_FILE = re.compile(r"(?:task-)?step-(\d+)\.json")


def eval_files(eval_dir: str | Path) -> dict[int, Path]:
    """The held-out result files of a run by step: `step-NNNNNN.json` or dpo's `task-step-NNNNNN.json`
    (a step with both keeps `step-`)."""
    found: dict[int, Path] = {}
    for path in sorted(Path(eval_dir).glob("*.json")):
        match = EVAL_FILE.fullmatch(path.name)
        if match and (int(match.group(1)) not in found or not path.name.startswith("task-")):
            found[int(match.group(1))] = path
    return found


def checker_verdict(row: dict[str, Any]) -> str:
    """The checker's verdict on one eval row, as acceptance counts it: "correct" when the status is ok
    and reward >= 1, "incorrect" when ok otherwise, else the status itself ("infra_error", ...).

    >>> checker_verdict({"status": "ok", "reward": 1.0}), checker_verdict({"status": "ok", "reward": 0.5})
    ('correct', 'incorrect')
    """
    if row.get("status") != "ok":
        return str(row.get("status"))
    reward = row.get("reward")
    return "correct" if reward is not None and reward >= 1.0 else "incorrect"


def sample_rows(rows: Sequence[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """`min(n, len(rows))` rows drawn without replacement by `random.Random(seed)`, kept in the eval
    file's order, each as {id, prompt, gold, completion, extracted, reward, status, reason, verdict}
    (without gold and extracted from an eval file written before its rows kept them), and a tool
    episode's `transcript` (the whole episode, the model's and the tools' spans marked).

    Raises UserError when the drawn ids are not unique (marks are keyed by id).
    """
    indices = sorted(random.Random(seed).sample(range(len(rows)), min(n, len(rows))))
    sample = [{key: rows[i].get(key) for key in ("id", "prompt", "gold", "completion", "extracted", "reward", "status", "reason", "transcript")
               if key in rows[i] or key not in ("gold", "extracted", "transcript")}
              | {"verdict": checker_verdict(rows[i])} for i in indices]
    ids = [row["id"] for row in sample]
    if len(set(map(json.dumps, ids))) != len(ids):
        raise UserError("the eval file's rows have repeated ids: marks could not tell them apart")
    return sample


def _key(row_id: Any) -> str:
    return json.dumps(row_id)  # ids may be strings or numbers; 1 and "1" stay different


def parse_marks(data: Any, sample: Sequence[dict[str, Any]], source: str = "marks") -> dict[str, str | None]:
    """Check a marks list (marks.json, as loaded) against the sample and return mark by id key.

    Every row needs an `id` of the sample and a `mark` in agree | disagree | unsure | null; an id may
    appear once; a `verdict`, when given, must be the sample's. Sample rows absent from the list are
    unmarked. Raises UserError naming the first bad row.
    """
    if not isinstance(data, list):
        raise UserError(f"{source}: expected a JSON list of {{\"id\", \"verdict\", \"mark\"}} rows")
    verdicts = {_key(row["id"]): row["verdict"] for row in sample}
    marks: dict[str, str | None] = {}
    for number, row in enumerate(data, 1):
        where = f"{source} row {number}"
        if not isinstance(row, dict) or "id" not in row or "mark" not in row:
            raise UserError(f"{where}: expected an object with \"id\" and \"mark\"")
        key = _key(row["id"])
        if key not in verdicts:
            raise UserError(f"{where}: id {key} is not in the review sample")
        if key in marks:
            raise UserError(f"{where}: id {key} is marked twice")
        if row["mark"] is not None and row["mark"] not in MARKS:
            raise UserError(f"{where} (id {key}): mark {json.dumps(row['mark'])} is not agree | disagree | unsure | null")
        if "verdict" in row and row["verdict"] != verdicts[key]:
            raise UserError(f"{where} (id {key}): verdict {json.dumps(row['verdict'])} is not the checker's {verdicts[key]!r}")
        marks[key] = row["mark"]
    return marks


def marks_rows(sample: Sequence[dict[str, Any]], marks: dict[str, str | None] | None = None) -> list[dict[str, Any]]:
    """marks.json's rows for the sample: {id, verdict, mark}, mark from `marks` (by id key) or null."""
    marks = marks or {}
    return [{"id": row["id"], "verdict": row["verdict"], "mark": marks.get(_key(row["id"]))} for row in sample]


@dataclass
class ReviewScore:
    """Checker-human agreement over one sample's marks."""

    agreed: int
    disagreed: int
    unsure: int
    unmarked: int
    agreement: float | None  # agreed / (agreed + disagreed); None when that is 0
    ci95: tuple[float, float]  # Wilson interval of `agreement`
    disagreements: list[dict[str, Any]] = field(default_factory=list)  # sample rows marked disagree

    @property
    def n_marked(self) -> int:
        """Rows marked agree or disagree: the agreement's denominator."""
        return self.agreed + self.disagreed


def score_marks(sample: Sequence[dict[str, Any]], marks: dict[str, str | None]) -> ReviewScore:
    """Agreement of the person's marks with the checker's verdicts.

    Example: 7 agree, 2 disagree, 1 unsure of 10 -> agreement 7/9 = 0.778, Wilson (0.453, 0.937),
    1 unsure and 0 unmarked left out.
    """
    given = [marks.get(_key(row["id"])) for row in sample]
    agreed, disagreed = given.count("agree"), given.count("disagree")
    return ReviewScore(
        agreed=agreed,
        disagreed=disagreed,
        unsure=given.count("unsure"),
        unmarked=given.count(None),
        agreement=agreed / (agreed + disagreed) if agreed + disagreed else None,
        ci95=wilson_interval(agreed, agreed + disagreed),
        disagreements=[row for row, mark in zip(sample, given) if mark == "disagree"],
    )


def _script_json(value: Any) -> str:
    """JSON safe inside a <script> element: no `</script>`, `<!--` or line separators can appear."""
    text = json.dumps(value)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
.row { border: 1px solid #ccc; border-radius: 4px; padding: 0.5rem 1rem; margin: 1rem 0; }
.row h3, .row p { margin: 0.4rem 0; }
pre { white-space: pre-wrap; word-break: break-word; background: #f6f6f6; padding: 0.5rem; max-height: 20rem; overflow: auto; }
.verdict { font-weight: bold; }
.answers { display: flex; gap: 2rem; }
.answers code { background: #eef; padding: 0.1rem 0.3rem; }
.bar { position: sticky; top: 0; background: #fff; padding: 0.5rem 0; border-bottom: 1px solid #ccc; }
label { margin-right: 1.5rem; }
"""

_SCRIPT = """
const ROWS = JSON.parse(document.getElementById("rows").textContent);
function current() {
  return ROWS.map((row, i) => {
    const checked = document.querySelector('input[name="mark-' + i + '"]:checked');
    return {id: row.id, verdict: row.verdict, mark: checked ? checked.value : null};
  });
}
function count() {
  const marked = current().filter(r => r.mark !== null).length;
  document.getElementById("count").textContent = marked + " of " + ROWS.length + " marked";
}
ROWS.forEach((row, i) => {
  if (row.mark !== null) {
    const input = document.querySelector('input[name="mark-' + i + '"][value="' + row.mark + '"]');
    if (input) input.checked = true;
  }
});
document.querySelectorAll("input[type=radio]").forEach(input => input.addEventListener("change", count));
document.getElementById("save").addEventListener("click", () => {
  const text = "[\\n" + current().map(row => JSON.stringify(row)).join(",\\n") + "\\n]\\n";  // one row a line, as marks.json
  const blob = new Blob([text], {type: "application/json"});
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = "marks.json";
  document.body.appendChild(link);
  link.click();
  link.remove();
});
count();
"""


def _shown(row: dict[str, Any], key: str, missing: str) -> str:
    """A row's gold or extracted answer as the sheet shows it: `missing` when it is None, "not
    recorded" when the eval file's rows did not keep it (written before they did)."""
    if key not in row:
        return "not recorded"
    return missing if row[key] is None else str(row[key])


def render_sheet(sample: Sequence[dict[str, Any]], marks: Sequence[dict[str, Any]], title: str) -> str:
    """The review sheet: one self-contained HTML page (inline CSS and JS, nothing fetched).

    Per row: the checker's verdict, reward, status and reason, the prompt, the gold answer and the
    answer the checker read (`extracted`; "none read" when it read none, "not recorded" in an
    older eval file), the completion (pre-formatted), and agree / disagree / unsure radio buttons
    preset from `marks` (marks.json's
    rows, in sample order). "Save marks" downloads the current marks as marks.json. Every shown text
    is HTML-escaped and the embedded marks are script-safe JSON: completions are untrusted output.
    """
    escape = html.escape
    parts = []
    for index, row in enumerate(sample):
        radios = "".join(f'<label><input type="radio" name="mark-{index}" value="{mark}"> {mark}</label>' for mark in MARKS)
        parts.append(
            f'<div class="row" id="row-{index}">\n'
            f"<h3>{index + 1}. {escape(str(row['id']))}</h3>\n"
            f'<p>checker: <span class="verdict">{escape(row["verdict"])}</span> (reward {escape(json.dumps(row["reward"]))}, '
            f"status {escape(str(row['status']))}); reason: {escape(str(row['reason'] or ''))}</p>\n"
            f"<p>prompt</p><pre>{escape(str(row['prompt'] or ''))}</pre>\n"
            f'<p class="answers"><span>gold: <code>{escape(_shown(row, "gold", "none (the tests decide)"))}</code></span>'
            f'<span>checker read: <code>{escape(_shown(row, "extracted", "none read"))}</code></span></p>\n'
            f"<p>completion</p><pre>{escape(str(row['completion'] or ''))}</pre>\n"
            + (f"<p>the whole episode ([model]: what the model wrote; [tool ...]: what the tools answered)</p>"
               f"<pre class=\"transcript\">{escape(str(row['transcript']))}</pre>\n" if row.get("transcript") else "")
            + f"<p>{radios}</p>\n</div>"
        )
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title>", f"<style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        "<p>Is the checker's verdict right? Mark each row <b>agree</b>, <b>disagree</b> or <b>unsure</b>, then save "
        "the marks and score them with <code>posttrain review RUN_DIR --score marks.json</code>.</p>",
        '<div class="bar"><button id="save" type="button">Save marks</button> <span id="count"></span></div>',
        *parts,
        f'<script id="rows" type="application/json">{_script_json(list(marks))}</script>',
        f"<script>{_SCRIPT}</script>", "</body></html>", "",
    ])


def card_entry(score: ReviewScore, marks_file: str, step: int) -> dict[str, Any]:
    """The run card's `links.acceptance.human_review` entry of a score."""
    return {
        "step": step,
        "n_marked": score.n_marked,
        "agreement": score.agreement,
        "ci95": list(score.ci95),
        "disagreements": score.disagreed,
        "unsure": score.unsure,
        "unmarked": score.unmarked,
        "marks": marks_file,
    }
