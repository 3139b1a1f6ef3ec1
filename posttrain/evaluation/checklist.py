"""The evaluation checklist before any conclusion, answered for a run (runs compared side by side:
`run_comparison`).

"The score went up: does that support the claim?" The specification (seed/README.md) asks, before any conclusion: are there
problems never used in training, is the checker independent (not "the same flawed checking logic on
new problems"), edge cases and new kinds of input, a human spot check, and, when two methods are
compared, can the four links be named for both sides. A run directory already records every
ingredient (run_card.json, metrics.jsonl, eval/); this module reads them (`run_record`) and answers each
question `yes`, `no` or `not measured`, with the run's own number and where it came from, then a
one-sentence verdict. `posttrain checklist` prints it (or `--json`), and every run card ends with
it (`runs.skeleton.closing`).

    heldout      held-out problems never trained on (the overlap check's count), how many
    independent  the held-out checker shares no logic with the training reward (the card's reason)
    interval     the in-distribution gain's 95% interval lies above zero (paired over the same
                 problems; else Newcombe's interval from the two Wilson intervals)
    shifted      each shifted held-out set: the gain carried, stayed flat or reversed ("no": one fell)
    audit        `posttrain audit` of the training reward, and a code dataset's weak tests excluded
    alarms       the divergence alarm (online) or likelihood-displacement alarm (preference): silent
    review       a person's marks (`posttrain review`): agreement with the checker >= MIN_AGREEMENT
                 (suggested only where the run has held-out rows a checker scored)
    signal       the training signal: unscorable rows <= MAX_UNSCORABLE, groups without variance
                 <= MAX_ZERO_VARIANCE, no step without reward signal (the advantage estimator's
                 own count, evaluation/signal.py)
    seeds        more than one seed: one seed is one sample

A run that has not finished (no end record in its card, or its last logged step short of the steps
it was set to run: it died, was stopped, or is still running) is said first (`Progress`), and only
the answers its record supports stand (`STANDS_UNFINISHED`); the others are "not measured (run
unfinished)" with what the record shows so far, and the verdict concludes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.evaluation.acceptance import IN_DISTRIBUTION
from posttrain.evaluation.run_record import Progress, Run, eval_file, read_run, set_change
from posttrain.runs.card import OTHER, span_text

YES, NO, NOT_MEASURED = "yes", "no", "not measured"
QUESTIONS = {
    "heldout": "held-out problems never trained on",
    "independent": "held-out checker independent of the training reward",
    "interval": "held-out gain's 95% interval above zero",
    "shifted": "shifted held-out sets: the gain carries, none fell",
    "audit": "training reward audited (code: weak tests excluded)",
    "alarms": "divergence / displacement alarm silent",
    "review": "human spot check agrees with the checker",
    "signal": "training signal: rows scored, rewards that differ",
    "seeds": "more than one seed",
}
"""A run's questions, by the name `--require` takes, in the order they are answered."""
COMPARISON_QUESTIONS = {
    "comparable": "the same held-out sets scored by the same checker",
    "attributable": "exactly one link differs",
}
"""A comparison's questions (answered for each run against the first by `run_comparison.compare`;
declared here, where `Answer.question` names them)."""
MIN_AGREEMENT = 0.9
"""Checker-human agreement below this is a "no": a person overruled the checker on more than 1 row in 10."""
MAX_UNSCORABLE = 0.05
"""Training rows the reward could not score (infra + data errors) above this fraction are a "no"."""
MAX_ZERO_VARIANCE = 0.5
"""Groups whose rewards were all equal (no policy-gradient signal) above this mean fraction are a "no"."""


STANDS_UNFINISHED = {
    "heldout": {YES}, "independent": {YES, NO, NOT_MEASURED}, "interval": set(), "shifted": set(),
    "audit": {YES, NO, NOT_MEASURED}, "alarms": {NO}, "review": {YES, NO}, "signal": {NO}, "seeds": {YES, NO},
}
"""The answers an unfinished run's record supports, by question: what its card holds from the start
(held-out problems kept apart, the checker's independence, the audit of its reward, its seed) and
what has already happened (an alarm that rang, a weak training signal, a person's marks). Any other
answer (a gain, a silent alarm, a held-out set not yet evaluated) waits for the run's end."""


@dataclass
class Answer:
    """One question answered: `answer` is yes / no / not measured, `detail` the run's own number
    and where it came from, `numbers` the same numbers for programs (--json)."""

    name: str
    answer: str
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        return QUESTIONS.get(self.name) or COMPARISON_QUESTIONS[self.name]

    def record(self) -> dict[str, Any]:
        """The answer as JSON (the run card's checklist section, --json)."""
        return {"name": self.name, "question": self.question, "answer": self.answer, "detail": self.detail, "numbers": self.numbers}


@dataclass
class Checklist:
    """A run's answers (in `QUESTIONS` order) and its verdict; `unfinished`: the line that says the
    run has not finished (`Progress.text`), said before the answers; None when it has."""

    run: Run
    answers: dict[str, Answer]
    verdict: str
    unfinished: str | None = None

    def record(self) -> dict[str, Any]:
        """The checklist as JSON: the run card's "checklist" section and one entry of --json."""
        return {"run_dir": str(self.run.path), "recipe": self.run.recipe, "seed": self.run.seed, "unfinished": self.unfinished,
                "answers": [answer.record() for answer in self.answers.values()], "verdict": self.verdict}


def heldout_answer(run: Run) -> Answer:
    """1. Held-out problems never trained on: how many, and the overlap check's count."""
    data, sets = run.link("data"), run.link("acceptance").get("sets") or {}
    entry = run.results.get("sets", {}).get(IN_DISTRIBUTION)
    last = eval_file(run, IN_DISTRIBUTION, entry["end"]["step"]) if entry else None
    problems = (last or {}).get("summary", {}).get("problems") or data.get("heldout_prompts") or data.get("heldout_examples")
    overlap = next((key for key in ("duplicates_removed", "removed_heldout_task_overlap") if key in data), None)
    shifted = {name: spec["training_prompts_removed"] for name, spec in sets.items()
               if isinstance(spec, dict) and "training_prompts_removed" in spec}
    shifted_text = ("; shifted sets: " + ", ".join(f"{name} {count} removed" for name, count in shifted.items())) if shifted else ""
    numbers = {"problems": problems, "overlap_removed": data.get(overlap) if overlap else None, "shifted_removed": shifted}
    if entry and problems:
        if overlap is None:
            return Answer("heldout", NOT_MEASURED, f"{problems} held-out problems, but the card records no overlap check with training",
                          numbers)
        return Answer("heldout", YES, f"{problems} held-out problems; the overlap check removed {data[overlap]} training prompts "
                                      f"equal to held-out ones (links.data.{overlap}){shifted_text}", numbers)
    pairs = data.get("heldout_pairs")
    if isinstance(pairs, int) and pairs > 0 and data.get("heldout_pairs_from"):
        return Answer("heldout", YES, f"{pairs} held-out pairs (links.data.heldout_pairs), {data['heldout_pairs_from']}; "
                                      "no held-out problem scored by a checker", {**numbers, "pairs": pairs})
    return Answer("heldout", NO, "no held-out problem was evaluated (results.sets is empty)", numbers)


def independent_answer(run: Run) -> Answer:
    """2. The held-out checker independent of the training reward (the card's reason)."""
    acceptance = run.link("acceptance")
    if "independent" not in acceptance:
        return Answer("independent", NOT_MEASURED, f"the card records no checker independence ({run.recipe}'s acceptance: "
                                                   f"{acceptance.get('measure') or acceptance.get('heldout') or 'none'})")
    dependent = sorted(name for name, spec in (acceptance.get("sets") or {}).items()
                       if isinstance(spec, dict) and spec.get("independent") is False)
    reason = acceptance.get("independence_reason", "no reason recorded")
    numbers = {"independent": acceptance["independent"], "checker": acceptance.get("checker_resolved") or acceptance.get("checker"),
               "dependent_sets": dependent}
    if not acceptance["independent"]:
        return Answer("independent", NO, f"{reason} (links.acceptance.independence_reason)", numbers)
    if dependent:
        return Answer("independent", NO, f"in-distribution: {reason}; but the checker of {', '.join(dependent)} is not independent "
                                         "(links.acceptance.sets)", numbers)
    return Answer("independent", YES, f"{reason} (links.acceptance.independence_reason)", numbers)


def interval_answer(run: Run) -> Answer:
    """3. The in-distribution gain's 95% interval lies above zero."""
    change = set_change(run, IN_DISTRIBUTION)
    if change is None:
        entry = run.results.get("sets", {}).get(IN_DISTRIBUTION)
        other = "; ".join(f"{OTHER.get(key, key)} {span_text(span)}" for key, span in run.results.get("heldout", {}).items())
        why = (f"held-out pass@1 evaluated once (step {entry['start']['step']})" if entry else "no held-out pass@1")
        return Answer("interval", NOT_MEASURED, why + (f"; other held-out measures, without a gain interval: {other}" if other else ""))
    source = f"{IN_DISTRIBUTION}: {change.text()} (results.sets.{IN_DISTRIBUTION})"
    if change.direction == "carried":
        return Answer("interval", YES, source, change.numbers())
    if change.direction == "unknown":
        return Answer("interval", NOT_MEASURED, source, change.numbers())
    said = "the held-out score fell" if change.direction == "reversed" else "no gain beyond noise"
    return Answer("interval", NO, f"{said}: {source}", change.numbers())


def shifted_answer(run: Run) -> Answer:
    """4. Shifted held-out sets: did the gain carry, stay flat or reverse (each with its interval)."""
    names = [name for name in run.results.get("sets", {}) if name != IN_DISTRIBUTION]
    if not names:
        return Answer("shifted", NOT_MEASURED, "no shifted held-out set (acceptance.sets names them)")
    changes = {name: set_change(run, name) for name in names}
    parts = [f"{name} {change.direction}: {change.text()}" if change else f"{name}: evaluated once" for name, change in changes.items()]
    numbers = {name: {"direction": change.direction, **change.numbers()} if change else None for name, change in changes.items()}
    detail = "; ".join(parts) + " (results.sets)"
    if any(change and change.direction == "reversed" for change in changes.values()):
        return Answer("shifted", NO, detail, numbers)
    if all(change is None or change.direction == "unknown" for change in changes.values()):
        return Answer("shifted", NOT_MEASURED, detail, numbers)
    return Answer("shifted", YES, detail, numbers)


def _reward_verifier(run: Run) -> str | None:
    """The training reward's name: an online run's verifier, a preference run's labeller, None for SFT."""
    reward = run.link("reward")
    return reward.get("verifier") if isinstance(reward.get("verifier"), str) else None


def audited_reward(run: Run) -> str | None:
    """The `posttrain audit --verifier` name of the run's training reward, the only audit its
    audit.json may hold (`math` for math, `callable` for callable:m.f, which has no suite); None
    without a training reward (SFT)."""
    verifier = _reward_verifier(run)
    return None if verifier is None else verifier.split(":", 1)[0]


def audit_answer(run: Run) -> Answer:
    """5. The training reward audited, and for code data the dataset's weak tests found and excluded.
    `posttrain audit --verifier X --record RUN_DIR` leaves RUN_DIR/audit.json: yes when every case of
    the run's reward's suite passed in the sandbox, no otherwise; without it, "not measured" with the
    command that measures it."""
    from posttrain.rewards.audit import SUITES

    verifier, screening = _reward_verifier(run), run.link("data").get("screening")
    weak = (screening or {}).get("weak_tests")
    numbers = {"verifier": verifier, "weak_tests": weak}
    if screening is not None and weak is None:
        return Answer("audit", NO, "code data whose weak tests were not looked for (data.exclude_weak_tests false; "
                                   "`posttrain audit --data ...` finds them)", numbers)
    weak_text = (f"; weak tests: {weak['excluded']} of {weak['checked']} training problems accepted a trivial program and "
                 "were excluded (links.data.screening.weak_tests)") if weak else ""
    if verifier is None:
        return Answer("audit", NOT_MEASURED, f"no training reward to audit ({run.link('reward').get('kind') or run.recipe}){weak_text}",
                      numbers)
    name = audited_reward(run)
    record = _audit_record(run)
    if record is not None and record.get("verifier") == name:
        numbers["audit"] = {key: record.get(key) for key in ("cases", "passed", "exploit", "date", "unsafe_no_sandbox")}
        detail = (f"`posttrain audit --verifier {name}`: {record['passed']} of {record['cases']} cases passed "
                  f"({record.get('exploit', '?')} exploits; {record.get('date', '?')}; audit.json){weak_text}")
        if record["passed"] == record["cases"] and not record.get("unsafe_no_sandbox"):
            return Answer("audit", YES, detail, numbers)
        failures = ", ".join(f"{f['kind']} {f['name']!r}" for f in record.get("failures", [])[:3])
        return Answer("audit", NO, detail + (f"; failed: {failures}" if failures else "; ran without the sandbox"), numbers)
    how = (f"run `posttrain audit --verifier {name} --record {run.path}`" if name in SUITES
           else f"`posttrain audit` has no suite for {verifier} (suites: {', '.join(SUITES)})")
    return Answer("audit", NOT_MEASURED, f"the run records no audit of its reward {verifier}: {how}{weak_text}", numbers)


def _audit_record(run: Run) -> dict[str, Any] | None:
    """The run's audit.json (`posttrain audit --verifier X --record RUN_DIR`), None when absent or unreadable."""
    path = run.path / "audit.json"
    try:
        record = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "passed" in record and "cases" in record else None


def alarms_answer(run: Run) -> Answer:
    """6. The divergence alarm (online runs) or likelihood-displacement alarm (preference runs):
    silent, or rang (when, with the numbers); "not measured" when the run was too short to ring."""
    acceptance, alarms = run.link("acceptance"), [str(alarm) for alarm in run.card.get("alarms") or []]
    if "divergence_alarm_threshold" in acceptance:
        rang = [alarm for alarm in alarms if alarm.startswith("divergence")]
        window = acceptance.get("alarm_window", 0)
        seen = sum(1 for row in run.rows if row.get("heldout/pass@1") is not None and row["step"] > 0)
        kind, what = "divergence", f"divergence alarm ({acceptance['divergence_alarm_threshold']}, window {window} evaluations)"
    elif "displacement_threshold" in acceptance:
        if str(acceptance.get("displacement_alarm", "")).startswith("off"):
            return Answer("alarms", NOT_MEASURED, f"displacement alarm {acceptance['displacement_alarm']}")
        rang = [alarm for alarm in alarms if alarm.startswith("likelihood displacement")]
        window = 2  # DisplacementAlarm compares once it has two steps
        seen = sum(1 for row in run.rows if row.get("logratio/chosen") is not None)
        kind, what = "likelihood-displacement", (f"likelihood-displacement alarm (threshold {acceptance['displacement_threshold']} nats, "
                                                 f"window {acceptance.get('alarm_window')} steps)")
    else:
        return Answer("alarms", NOT_MEASURED, f"{run.recipe} has no divergence or displacement alarm (no training reward to watch)")
    numbers = {"alarm": kind, "settings": what, "observations": seen, "rang": rang}
    if rang:
        return Answer("alarms", NO, f"the {what} rang: {rang[0]} (card: alarms)", numbers)
    if seen < window:
        return Answer("alarms", NOT_MEASURED, f"the {what} saw {seen} observations, fewer than it needs to ring", numbers)
    return Answer("alarms", YES, f"the {what} stayed silent over {seen} observations (card: alarms)", numbers)


def review_answer(run: Run) -> Answer:
    """7. Human spot check: the marks' agreement with the checker and its interval, or "not done"
    with the command that does it."""
    review = run.link("acceptance").get("human_review")
    if not isinstance(review, dict) or not review.get("n_marked"):
        done = "marked no row agree or disagree" if isinstance(review, dict) else "not done"
        if not _reviewable(run):
            acceptance = run.link("acceptance")
            measure = f"; its acceptance: {acceptance['metric']} of the {acceptance.get('heldout')}" if acceptance.get("metric") else ""
            return Answer("review", NOT_MEASURED, f"{done}, and nothing to review: the run has no held-out rows a checker scored "
                                                  f"(eval/step-N.json, what `posttrain review` shows){measure}")
        return Answer("review", NOT_MEASURED, f"{done}: `posttrain review {run.path}`, mark the sheet, then "
                                              f"`posttrain review {run.path} --score {run.path / 'review' / 'marks.json'}`")
    agreement, (low, high) = review["agreement"], review["ci95"]
    numbers = {"agreement": agreement, "ci95": [low, high], "n_marked": review["n_marked"], "step": review.get("step")}
    detail = (f"agreement {agreement:.3f} [{low:.3f}, {high:.3f}] over {review['n_marked']} marked rows of step {review.get('step')}, "
              f"{review.get('disagreements', 0)} disagreements (links.acceptance.human_review)")
    if agreement < MIN_AGREEMENT:
        return Answer("review", NO, f"{detail}: below {MIN_AGREEMENT}", numbers)
    return Answer("review", YES, detail, numbers)


def _reviewable(run: Run) -> bool:
    """Whether `posttrain review` can make a sheet of the run: its last eval file holds held-out rows."""
    from posttrain.evaluation.review import eval_files

    files = eval_files(run.path / "eval")
    if not files:
        return False
    try:
        rows = json.loads(files[max(files)].read_text()).get("rows")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False
    return isinstance(rows, list) and bool(rows)


def signal_answer(run: Run) -> Answer:
    """8. The training signal: unscorable rows, groups without reward variance, steps without signal."""
    signal = run.card.get("training_signal")
    if not isinstance(signal, dict):
        return Answer("signal", NOT_MEASURED, f"{run.recipe} scores no rows while training (no training_signal section)")
    if not signal.get("rows"):
        return Answer("signal", NOT_MEASURED, "the card's training_signal counts no scored row (no step recorded)")
    unscorable = (signal.get("infra_error_rate") or 0) + (signal.get("data_error_rate") or 0)
    zero = signal.get("zero_variance_group_fraction")
    numbers = {key: signal.get(key) for key in ("steps", "rows", "infra_error_rate", "data_error_rate", "zero_variance_group_fraction",
                                                "steps_without_reward_signal", "alarm")}
    detail = (f"{signal['rows']} rows over {signal['steps']} steps: {signal['infra_error_rate']:.1%} infra errors, "
              f"{signal['data_error_rate']:.1%} data errors" + ("" if zero is None else f", {zero:.1%} of groups without reward variance")
              + f", {signal['steps_without_reward_signal']} steps without reward signal (card: training_signal)")
    problems = ([f"more than {MAX_UNSCORABLE:.0%} unscorable"] if unscorable > MAX_UNSCORABLE else []) \
        + ([f"more than {MAX_ZERO_VARIANCE:.0%} of groups without variance"] if zero is not None and zero > MAX_ZERO_VARIANCE else []) \
        + ([f"the alarm rang: {signal['alarm']}"] if signal.get("alarm") else [])
    if problems or signal.get("steps_without_reward_signal"):
        return Answer("signal", NO, detail + (": " + "; ".join(problems) if problems else ""), numbers)
    return Answer("signal", YES, detail, numbers)


def seeds_answer(run: Run, seeds: list | None = None) -> Answer:
    """9. How many seeds the claim rests on: `seeds` are those of the given runs with this run's
    links and settings (None: this run's own)."""
    seeds = sorted(set(seeds if seeds is not None else [run.seed]), key=str)
    if len(seeds) > 1:
        return Answer("seeds", YES, f"{len(seeds)} seeds ({', '.join(map(str, seeds))}) of the same links among the runs given",
                      {"seeds": seeds})
    return Answer("seeds", NO, f"one seed ({seeds[0]}): one seed is one sample; run more and pass them all to "
                               "`posttrain checklist`", {"seeds": seeds})


def checklist(run: Run, seeds: list | None = None) -> Checklist:
    """Every question of `QUESTIONS` answered for `run`, and the verdict."""
    answers = [heldout_answer(run), independent_answer(run), interval_answer(run), shifted_answer(run), audit_answer(run),
               alarms_answer(run), review_answer(run), signal_answer(run), seeds_answer(run, seeds)]
    answers = {answer.name: answer for answer in answers}
    progress = run.progress
    if not progress.finished:
        answers = {name: answer if answer.answer in STANDS_UNFINISHED[name] else
                   Answer(name, NOT_MEASURED, f"(run unfinished) so far: {answer.detail}", answer.numbers)
                   for name, answer in answers.items()}
        return Checklist(run, answers, verdict(answers, progress), progress.text(run.recipe, run.path))
    return Checklist(run, answers, verdict(answers))


def verdict(answers: dict[str, Answer], progress: Progress | None = None) -> str:
    """One sentence: whether the held-out gain supports the claim, what weakens it, what was not
    measured; for a run that has not finished (`progress`), no conclusion."""
    gain, numbers = answers["interval"], answers["interval"].numbers
    figure = f"{numbers['change']:+.3f} [{numbers['ci95'][0]:+.3f}, {numbers['ci95'][1]:+.3f}]" if numbers.get("ci95") else ""
    cautions = []
    if answers["independent"].answer == NO:
        cautions.append("the checker is not independent of the training reward, so the gain may be the checker's blind spot")
    if answers["heldout"].answer == NO:
        cautions.append("no held-out problem was kept apart from training")
    if answers["alarms"].answer == NO:
        cautions.append(f"the {answers['alarms'].numbers['alarm']} alarm rang")
    if answers["shifted"].answer == NO:
        fell = [name for name, entry in answers["shifted"].numbers.items() if entry and entry["direction"] == "reversed"]
        cautions.append(f"the shifted held-out set{'s' if len(fell) > 1 else ''} {', '.join(fell)} fell")
    if answers["signal"].answer == NO:
        cautions.append("the training signal was weak")
    if answers["review"].answer == NO:
        cautions.append("a person disagreed with the checker too often")
    but = "; ".join(cautions)
    if progress is not None and not progress.finished:
        head = f"Nothing to conclude: the run is unfinished ({progress.where})" + (f"; already: {but}" if but else "")
    elif gain.answer == YES and not cautions:
        head = f"Supported on this task: the held-out gain {figure} on problems never trained on, by an independent checker, no alarm rang"
    elif gain.answer == YES:
        head = f"Not yet supported: the held-out gain is {figure}, but {but}"
    elif gain.answer == NO:
        said = "the held-out score fell" if numbers["ci95"][1] < 0 else "the held-out change is within noise"
        head = f"Not supported: {said}, {figure}" + (f"; {but}" if but else "")
    else:
        head = "Nothing to conclude: no held-out gain with an interval" + (f"; {but}" if but else "")
    unmeasured = [name for name, answer in answers.items() if answer.answer == NOT_MEASURED]
    tail = (f"; not measured: {', '.join(unmeasured)}" if unmeasured else "") + (
        "; one seed is one sample" if answers["seeds"].answer == NO else "")
    return head + tail + "."


def card_section(run_dir: str | Path, card: dict[str, Any]) -> dict[str, Any]:
    """The run card's "checklist" section of the run being closed in `run_dir` (its `card` in
    memory, results included): every answer and the verdict, for this run alone (one seed)."""
    found = checklist(read_run(run_dir, card))
    return {"unfinished": found.unfinished, "answers": [answer.record() for answer in found.answers.values()], "verdict": found.verdict}


def markdown(entry: Checklist) -> list[str]:
    """A run's checklist as a markdown table and its verdict (the demo's report)."""
    lines = [f"**{entry.unfinished}.**", ""] if entry.unfinished else []
    lines += ["| # | question | answer | the run's number and its source |", "|---|---|---|---|"]
    lines += [f"| {number} | {answer.question} | **{answer.answer}** | {cell(answer.detail)} |"
              for number, answer in enumerate(entry.answers.values(), 1)]
    return lines + ["", f"**Verdict.** {entry.verdict}", ""]


def cell(text: str) -> str:
    """`text` as one markdown table cell, pipes escaped and newlines as spaces: "a | b" -> "a \\| b"."""
    return str(text).replace("|", "\\|").replace("\n", " ")
