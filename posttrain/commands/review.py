"""`posttrain review`: a human spot check of a run's held-out checker, with measured agreement.

    posttrain review runs/sft-x                                 # review/sheet.html + review/marks.json
    posttrain review runs/sft-x --score review/marks.json       # agreement, review/score.json, run card

The sheet shows a seeded sample of the held-out rows of one evaluation (default: the last); a person
marks each checker verdict agree / disagree / unsure and saves marks.json (or edits it by hand).
Agreement is agreed / (agreed + disagreed), with a 95% Wilson interval (docs/metrics.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.errors import UserError


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"{what}: unreadable ({error})") from None
    except json.JSONDecodeError as error:
        raise UserError(f"{what}: not JSON ({error.msg}, line {error.lineno})") from None


def _write(files: dict[Path, str]) -> None:
    """Write every file atomically (`atomic.write_text_atomically`), only once all texts are built."""
    from posttrain.atomic import write_text_atomically

    for path, text in files.items():
        write_text_atomically(path, text)


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=1, ensure_ascii=False) + "\n"


def _dumps_marks(marks: list[dict[str, Any]]) -> str:
    """marks.json: one row a line, to edit by hand (the sheet's download writes the same)."""
    return "[\n" + ",\n".join(json.dumps(row, ensure_ascii=False) for row in marks) + "\n]\n"


def write_sheet(run_dir: Path, n: int, step: int | None, seed: int) -> int:
    from posttrain.evaluation.review import eval_files, marks_rows, parse_marks, render_sheet, sample_rows

    files = eval_files(run_dir / "eval")
    if not files:
        raise UserError(f"{run_dir}: no eval results (eval/step-NNNNNN.json or eval/task-step-NNNNNN.json)")
    step = max(files) if step is None else step
    if step not in files:
        raise UserError(f"--step {step}: no eval results at that step (steps with results: {', '.join(map(str, sorted(files)))})")
    if n < 1:
        raise UserError("--n must be at least 1")
    results = _read_json(files[step], str(files[step]))
    rows = results.get("rows") if isinstance(results, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) and "id" in row for row in rows):
        raise UserError(f"{files[step]}: no held-out rows (expected {{\"rows\": [{{\"id\", \"prompt\", \"completion\", ...}}]}})")
    sample = sample_rows(rows, n, seed)
    review = run_dir / "review"
    # Marks already made on this sample are kept; marks of another sample are not silently dropped.
    previous: dict[str, str | None] = {}
    if (review / "marks.json").exists():
        held = _read_json(review / "marks.json", str(review / "marks.json"))
        marked = [row for row in held if isinstance(row, dict) and row.get("mark") is not None] if isinstance(held, list) else held
        try:
            previous = parse_marks(marked, sample, source=f"{review / 'marks.json'} (its marked rows)")
        except UserError as error:
            raise UserError(f"{error}; move it away to start a sample of another --n / --step / --seed") from None
    marks = marks_rows(sample, previous)
    title = f"Review of {run_dir.name}: {len(sample)} held-out rows of step {step} (seed {seed})"
    record = {"eval_file": str(files[step].relative_to(run_dir)), "step": step, "seed": seed, "n": n, "rows": sample}
    _write({review / "sample.json": _dumps(record), review / "marks.json": _dumps_marks(marks),
            review / "sheet.html": render_sheet(sample, marks, title)})
    kept = sum(mark["mark"] is not None for mark in marks)
    print(f"review sheet: {review / 'sheet.html'} ({len(sample)} of {len(rows)} rows of {files[step].name}, seed {seed}"
          + (f"; {kept} marks kept" if kept else "") + ")")
    print(f"marks: {review / 'marks.json'} (the sheet's Save marks downloads the same format)")
    print(f"then:  posttrain review {run_dir} --score MARKS.json")
    return 0


def score(run_dir: Path, marks_path: Path) -> int:
    from posttrain.evaluation.review import card_entry, parse_marks, score_marks
    from posttrain.runs.card import render_markdown

    review = run_dir / "review"
    if not (review / "sample.json").exists():
        raise UserError(f"{run_dir}: no review sample; write one first with `posttrain review {run_dir}`")
    record = _read_json(review / "sample.json", str(review / "sample.json"))
    sample = record.get("rows") if isinstance(record, dict) else None
    if not isinstance(sample, list) or not all(isinstance(row, dict) and {"id", "verdict"} <= set(row) for row in sample):
        raise UserError(f"{review / 'sample.json'}: not a review sample; write it again with `posttrain review {run_dir}`")
    result = score_marks(sample, parse_marks(_read_json(marks_path, str(marks_path)), sample, source=str(marks_path)))
    resolved = marks_path.resolve()
    marks_file = str(resolved.relative_to(run_dir.resolve())) if resolved.is_relative_to(run_dir.resolve()) else str(resolved)
    entry = card_entry(result, marks_file, record.get("step"))
    report = {**entry, "eval_file": record.get("eval_file"), "seed": record.get("seed"), "sample": len(sample), "agreed": result.agreed,
              "disagreed": result.disagreed,
              "disagreements": [{key: row.get(key) for key in ("id", "verdict", "reward", "status", "reason", "completion")}
                                for row in result.disagreements]}
    files = {review / "score.json": _dumps(report)}
    card_path = run_dir / "run_card.json"
    if card_path.exists():
        card = _read_json(card_path, str(card_path))
        if not isinstance(card, dict) or "run" not in card or not isinstance(card.get("links"), dict):
            raise UserError(f"{card_path}: not a run card")
        if not isinstance(card["links"].setdefault("acceptance", {}), dict):
            raise UserError(f"{card_path}: links.acceptance is not an object")
        card["links"]["acceptance"]["human_review"] = entry
        if "checklist" in card:  # the card's checklist, written when the run ended, answers the review question again
            from posttrain.evaluation.checklist import card_section

            card["checklist"] = card_section(run_dir, card)
        files[card_path] = json.dumps(card, indent=2, default=str) + "\n"
        files[run_dir / "run_card.md"] = render_markdown(card)
    _write(files)

    if result.agreement is None:
        print(f"checker-human agreement at step {record.get('step')}: no row marked agree or disagree")
    else:
        low, high = result.ci95
        print(f"checker-human agreement at step {record.get('step')}: {result.agreed}/{result.n_marked} = {result.agreement:.3f}"
              f"  95% CI [{low:.3f}, {high:.3f}]")
    print(f"  left out: {result.unsure} unsure, {result.unmarked} unmarked (of {len(sample)} sampled)")
    print(f"disagreements ({result.disagreed}):")
    for row in result.disagreements:
        print(f"  {row['id']}  checker {row['verdict']}  reason: {row.get('reason')}  completion: {json.dumps(str(row.get('completion') or '')[:80], ensure_ascii=False)}")
    print(f"score: {review / 'score.json'}" + ("; run card: links.acceptance.human_review" if card_path.exists() else "; no run card to update"))
    return 0


def handle(args) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a run directory")
    if args.score is not None:
        given = [flag for flag, value in (("--n", args.n), ("--step", args.step), ("--seed", args.seed)) if value is not None]
        if given:
            raise UserError(f"{', '.join(given)}: --score scores the sample in review/sample.json; these flags choose a new sample")
        return score(run_dir, Path(args.score))
    return write_sheet(run_dir, 50 if args.n is None else args.n, args.step, 0 if args.seed is None else args.seed)


def register(subparsers) -> None:
    parser = subparsers.add_parser("review", help="a human spot check of the held-out checker, with agreement",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with eval/ results")
    parser.add_argument("--n", type=int, default=None, help="rows to sample (default 50)")
    parser.add_argument("--step", type=int, default=None, help="the evaluation step (default: the last with results)")
    parser.add_argument("--seed", type=int, default=None, help="the sample's seed (default 0)")
    parser.add_argument("--score", default=None, metavar="MARKS.json", help="score these marks instead of writing a sheet")
    parser.set_defaults(func=handle)
