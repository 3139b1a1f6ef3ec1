"""`posttrain review`: a seeded sample of a run's held-out rows on an HTML sheet, a person's marks,
and the checker-human agreement with its Wilson interval in score.json and the run card."""

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.evaluation.stats import wilson_interval
from posttrain.runs import new_card, write_run_card

INJECTION = '<script>window.injected = 1</script><b>bold</b> & <answer>7</answer>'


def eval_rows(prefix: str, n: int = 30) -> list[dict]:
    """Rows in the shape evaluate_task writes: every third row wrong, row 4 an infra error, row 5
    an injection attempt, a long completion on row 7."""
    rows = []
    for i in range(n):
        correct = i % 3 != 0
        rows.append({"id": f"{prefix}-{i}", "prompt": f"<|im_start|>user\n{i}+{i}=<|im_end|>\n<|im_start|>assistant\n",
                     "completion": f"<answer>{2 * i if correct else i}</answer>", "reward": 1.0 if correct else 0.0,
                     "status": "ok", "reason": "exact match" if correct else "wrong answer"})
    rows[4] |= {"reward": None, "status": "infra_error", "reason": "sandbox died"}
    rows[5]["completion"] = INJECTION
    rows[7]["completion"] = "x" * 79 + "END-OF-80" + "y" * 50
    return rows


def verdict(row: dict) -> str:
    return row["status"] if row["status"] != "ok" else ("correct" if row["reward"] >= 1 else "incorrect")


def fake_run(tmp_path: Path, files=("step-000002.json", "step-000004.json")) -> Path:
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    for name in files:
        summary = {"task": "arithmetic", "split": "eval", "n": 30, "pass@1": 0.6}
        (run / "eval" / name).write_text(json.dumps({"summary": summary, "rows": eval_rows(name.split(".")[0])}, indent=1))
    card = new_card("sft", 0)
    card["links"]["acceptance"] = {"heldout": "arithmetic eval split", "checker": "exact"}
    write_run_card(run, card)
    return run


def read(path: Path):
    return json.loads(path.read_text())


def review(*argv) -> int:
    return main(["review", *map(str, argv)])


def one_error_line(capsys, message: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error:") and err.count("\n") == 1 and message in err, err


def test_sheet_is_a_seeded_sample_of_the_last_evaluation(tmp_path, capsys):
    """--n rows drawn by random.Random(seed) from the last step's rows, kept in file order; marks.json
    rows are exactly {id, verdict, mark} with the checker's verdict and mark null."""
    run = fake_run(tmp_path)
    assert review(run, "--n", 10, "--seed", 3) == 0
    marks = read(run / "review" / "marks.json")
    expected = [f"step-000004-{i}" for i in sorted(random.Random(3).sample(range(30), 10))]
    assert [row["id"] for row in marks] == expected
    assert all(set(row) == {"id", "verdict", "mark"} and row["mark"] is None for row in marks)
    rows = {row["id"]: row for row in eval_rows("step-000004")}
    assert [row["verdict"] for row in marks] == [verdict(rows[i]) for i in expected]
    sheet = (run / "review" / "sheet.html").read_text()
    assert review(run, "--n", 10, "--seed", 3) == 0  # the same seed: the same sheet
    assert (run / "review" / "sheet.html").read_text() == sheet
    shutil.rmtree(run / "review")
    assert review(run, "--n", 10, "--seed", 4) == 0
    assert [row["id"] for row in read(run / "review" / "marks.json")] != expected
    shutil.rmtree(run / "review")
    assert review(run) == 0  # default --n 50 of 30 rows: all of them
    assert len(read(run / "review" / "marks.json")) == 30
    assert {row["verdict"] for row in read(run / "review" / "marks.json")} == {"correct", "incorrect", "infra_error"}
    shutil.rmtree(run / "review")
    assert review(run, "--step", 2, "--n", 5) == 0
    assert all(row["id"].startswith("step-000002-") for row in read(run / "review" / "marks.json"))
    assert "5 of 30 rows of step-000002.json" in capsys.readouterr().out


def test_dpo_task_eval_files_are_read(tmp_path):
    run = fake_run(tmp_path, files=("task-step-000003.json",))
    assert review(run, "--n", 4) == 0
    assert read(run / "review" / "sample.json")["step"] == 3
    assert all(row["id"].startswith("task-step-000003-") for row in read(run / "review" / "marks.json"))


def test_sheet_escapes_untrusted_text(tmp_path):
    """A completion's tags are shown as text, and an id holding `</script>` cannot close the
    embedded marks: the only <script> elements are the page's two."""
    run = fake_run(tmp_path, files=("step-000001.json",))
    data = read(run / "eval" / "step-000001.json")
    data["rows"][0]["id"] = 'x</script><script>window.injected = 2</script>'
    (run / "eval" / "step-000001.json").write_text(json.dumps(data))
    assert review(run) == 0
    sheet = (run / "review" / "sheet.html").read_text()
    assert "&lt;script&gt;window.injected = 1&lt;/script&gt;&lt;b&gt;bold&lt;/b&gt; &amp; &lt;answer&gt;7" in sheet
    assert "window.injected = 1</script>" not in sheet and "<b>bold" not in sheet
    assert sheet.count("<script") == 2 and sheet.count("</script>") == 2
    assert "src=" not in sheet and "<link" not in sheet and "http" not in sheet  # nothing fetched


def write_marks(path: Path, marks: list[dict], counts: dict[str, int]) -> list[dict]:
    """Set the first rows' marks: counts["agree"] agree, then disagree, then unsure; the rest stay null."""
    given = [mark for mark in ("agree", "disagree", "unsure") for _ in range(counts.get(mark, 0))]
    marks = [dict(row, mark=mark) for row, mark in zip(marks, given)] + marks[len(given):]
    path.write_text(json.dumps(marks))
    return marks


def test_score_is_agreed_over_agreed_plus_disagreed(tmp_path, capsys):
    """7 agree, 2 disagree, 1 unsure, 2 unmarked of 12: agreement 7/9 = 0.778; Wilson with z = 1.96:
    centre (7/9 + z²/18) / (1 + z²/9) = 0.9912 / 1.4268 = 0.6947, half-width
    z·sqrt(7/9·2/9/9 + z²/324) / 1.4268 = 0.2421 -> [0.453, 0.937]; unsure and unmarked left out."""
    run = fake_run(tmp_path)
    assert review(run, "--n", 12) == 0
    marks = write_marks(tmp_path / "marks.json", read(run / "review" / "marks.json"), {"agree": 7, "disagree": 2, "unsure": 1})
    capsys.readouterr()
    assert review(run, "--score", tmp_path / "marks.json") == 0
    out = capsys.readouterr().out
    assert "7/9 = 0.778  95% CI [0.453, 0.937]" in out and "1 unsure, 2 unmarked (of 12 sampled)" in out
    score = read(run / "review" / "score.json")
    assert score["agreement"] == pytest.approx(7 / 9) and score["ci95"] == pytest.approx(list(wilson_interval(7, 9)))
    assert (score["agreed"], score["disagreed"], score["unsure"], score["unmarked"], score["n_marked"]) == (7, 2, 1, 2, 9)
    disagreed = [row["id"] for row in marks[7:9]]
    assert [row["id"] for row in score["disagreements"]] == disagreed
    for row_id in disagreed:
        assert row_id in out
    entry = read(run / "run_card.json")["links"]["acceptance"]["human_review"]
    assert entry == {"step": 4, "n_marked": 9, "agreement": pytest.approx(7 / 9), "ci95": pytest.approx([0.4526, 0.9368], abs=1e-4),
                     "disagreements": 2, "unsure": 1, "unmarked": 2, "marks": str((tmp_path / "marks.json").resolve())}
    assert read(run / "run_card.json")["links"]["acceptance"]["checker"] == "exact"  # the rest of the card is kept
    assert "human_review" in (run / "run_card.md").read_text()


def test_disagreements_show_the_first_80_characters(tmp_path, capsys):
    run = fake_run(tmp_path)
    assert review(run) == 0
    marks = read(run / "review" / "marks.json")
    marks[7]["mark"] = "disagree"  # step-000004-7: 79 x's, then "END-OF-80..."
    (run / "review" / "marks.json").write_text(json.dumps(marks))
    capsys.readouterr()
    assert review(run, "--score", run / "review" / "marks.json") == 0
    out = capsys.readouterr().out
    assert "0/1 = 0.000" in out and '"' + "x" * 79 + 'E"' in out and "END" not in out
    assert read(run / "run_card.json")["links"]["acceptance"]["human_review"]["marks"] == "review/marks.json"


def test_regenerating_keeps_the_marks(tmp_path, capsys):
    """Marks made on a sample survive writing its sheet again (marks.json and the sheet's embedded
    marks); marks of another sample are not dropped silently: the command refuses."""
    run = fake_run(tmp_path)
    assert review(run, "--n", 6) == 0
    marks = read(run / "review" / "marks.json")
    marks[1]["mark"], marks[4]["mark"] = "agree", "unsure"
    (run / "review" / "marks.json").write_text(json.dumps(marks))
    assert review(run, "--n", 6) == 0
    assert read(run / "review" / "marks.json") == marks
    assert '"mark": "unsure"' in (run / "review" / "sheet.html").read_text()
    assert "2 marks kept" in capsys.readouterr().out
    before = {path.name: path.read_text() for path in (run / "review").iterdir()}
    assert review(run, "--n", 6, "--seed", 1) == 2
    one_error_line(capsys, "is not in the review sample; move it away")
    assert {path.name: path.read_text() for path in (run / "review").iterdir()} == before


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    run = fake_run(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert review(empty) == 2
    one_error_line(capsys, "no eval results (eval/step-NNNNNN.json or eval/task-step-NNNNNN.json)")
    assert not (empty / "review").exists()
    assert review(run, "--score", tmp_path / "marks.json") == 2
    one_error_line(capsys, "no review sample; write one first")
    for argv, message in ((["--step", 3], "--step 3: no eval results at that step (steps with results: 2, 4)"),
                          (["--n", 0], "--n must be at least 1"),
                          ([tmp_path / "nowhere"], "not a run directory")):
        assert review(*([] if argv[0] == tmp_path / "nowhere" else [run]), *argv) == 2
        one_error_line(capsys, message)
    assert not (run / "review").exists()

    assert review(run, "--n", 5) == 0
    sample = read(run / "review" / "marks.json")
    card = (run / "run_card.json").read_text()
    bad_marks = {
        "unknown id": (sample + [{"id": "nope", "verdict": "correct", "mark": "agree"}], 'row 6: id "nope" is not in the review sample'),
        "bad mark": ([dict(sample[0], mark="yes")] + sample[1:], 'mark "yes" is not agree | disagree | unsure | null'),
        "twice": (sample + [sample[0]], "is marked twice"),
        "verdict changed": ([dict(sample[0], verdict="maybe")] + sample[1:], "verdict \"maybe\" is not the checker's"),
        "not a list": ({"marks": sample}, "expected a JSON list"),
    }
    for name, (marks, message) in bad_marks.items():
        (tmp_path / "marks.json").write_text(json.dumps(marks))
        assert review(run, "--score", tmp_path / "marks.json") == 2, name
        one_error_line(capsys, message)
    (tmp_path / "marks.json").write_text('[{"id": "step-000004-0", "mark": "agree"')
    assert review(run, "--score", tmp_path / "marks.json") == 2
    one_error_line(capsys, "marks.json: not JSON")
    assert review(run, "--score", tmp_path / "missing.json") == 2
    one_error_line(capsys, "missing.json: no such file")
    assert review(run, "--score", run / "review" / "marks.json", "--seed", 2) == 2
    one_error_line(capsys, "--seed: --score scores the sample in review/sample.json")
    assert not (run / "review" / "score.json").exists() and (run / "run_card.json").read_text() == card


def test_a_tiny_sft_run_reviewed_end_to_end(tmp_path, capsys):
    """The real eval file of a 2-step sft run: sample, mark every row agree, score 1.0."""
    run = tmp_path / "sft"
    assert main(["sft", "--max-steps", "2", "--batch-size", "4", "--micro-batch-size", "2", "--data.train_size", "40",
                 "--data.eval_size", "8", "--acceptance.max_new_tokens", "4", "--output-dir", str(run)]) == 0
    assert review(run, "--n", 5) == 0
    marks = [dict(row, mark="agree") for row in read(run / "review" / "marks.json")]
    assert len(marks) == 5 and all(row["id"].startswith("arithmetic-eval-") for row in marks)
    (run / "review" / "marks.json").write_text(json.dumps(marks))
    assert review(run, "--score", run / "review" / "marks.json") == 0
    assert "5/5 = 1.000" in capsys.readouterr().out
    entry = read(run / "run_card.json")["links"]["acceptance"]["human_review"]
    assert entry["step"] == 2 and entry["agreement"] == 1.0 and entry["n_marked"] == 5
    assert "human_review" in (run / "run_card.md").read_text()


@pytest.fixture
def browser(tmp_path):
    """Debian's chromium driven by selenium through Debian's chromium-driver (no download: the
    binaries are named). Skipped where they are missing; in CI (.ci/run installs them) that fails."""
    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if webdriver is None or chromium is None or chromedriver is None:
        missing = "selenium (pip install -e '.[dev]')" if webdriver is None else "chromium and chromium-driver (apt-get install)"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"the browser test needs {missing}")
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads), "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


def test_marks_made_in_a_browser_are_scored(tmp_path, browser, capsys):
    """Open the sheet in headless Chromium: the injected completion does not run and a mark held in
    marks.json is shown; mark two more rows, Save marks, score the downloaded marks.json."""
    from selenium.webdriver.common.by import By

    run = fake_run(tmp_path)
    assert review(run, "--n", 6, "--seed", 5) == 0
    marks = read(run / "review" / "marks.json")
    marks[0]["mark"] = "unsure"
    (run / "review" / "marks.json").write_text(json.dumps(marks))
    assert review(run, "--n", 6, "--seed", 5) == 0
    shutil.copy(run / "review" / "sheet.html", tmp_path / "sheet.html")
    shutil.rmtree(run / "review")
    assert review(run, "--n", 30) == 0  # all rows, the injected one included
    capsys.readouterr()
    sheet = (run / "review" / "sheet.html").resolve()

    browser.get(sheet.as_uri())
    assert browser.execute_script("return window.injected === undefined")
    assert INJECTION in browser.find_element(By.ID, "row-5").text
    browser.find_element(By.CSS_SELECTOR, 'input[name="mark-0"][value="agree"]').click()
    browser.find_element(By.CSS_SELECTOR, 'input[name="mark-3"][value="disagree"]').click()
    assert browser.find_element(By.ID, "count").text == "2 of 30 marked"
    browser.find_element(By.ID, "save").click()
    downloaded = browser.downloads / "marks.json"
    deadline = time.monotonic() + 10
    while not downloaded.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    saved = read(downloaded)
    assert [row["mark"] for row in saved] == ["agree", None, None, "disagree"] + [None] * 26
    assert [{"id": row["id"], "verdict": row["verdict"]} for row in saved] == [
        {"id": row["id"], "verdict": row["verdict"]} for row in read(run / "review" / "marks.json")]
    assert review(run, "--score", downloaded) == 0
    assert "1/2 = 0.500" in capsys.readouterr().out
    assert read(run / "run_card.json")["links"]["acceptance"]["human_review"]["disagreements"] == 1

    browser.get((tmp_path / "sheet.html").as_uri())  # the earlier sheet shows the mark marks.json held
    assert browser.find_element(By.CSS_SELECTOR, 'input[name="mark-0"][value="unsure"]').is_selected()
    assert browser.find_element(By.ID, "count").text == "1 of 6 marked"
