"""`posttrain compare`: a tiny comparison (a 20-step SFT start, one training step per row, 16
held-out problems) through the real recipe: the table's rows in order, every gain paired over the
same held-out problems as the start's (recomputed here from the eval files), a failing row reported
in one line while the others complete; the links column against the rows' own configs; a bad
--rows value one line before any work. About a minute on a 2-core VM (four row processes)."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import build_config, parse_overrides
from posttrain.evaluation.comparison_report import closing_lines
from posttrain.evaluation.stats import paired_difference_ci
from posttrain.recipes import compare, compare_samples, dpo_config, online_config, sft
from posttrain.recipes.demo import preset

ROOT = Path(__file__).resolve().parent.parent
ROWS = {row.name: row for row in compare.ROWS}
BROKEN = compare.Row("broken", "a row that fails", "grpo", ("--loss.advantage", "nonsense"))


def arithmetic_pairs(count: int = 24) -> list[dict]:
    """Correct vs wrong sums: a 20-step start is too weak for `posttrain pairs` to find any."""
    return [{"id": f"p{index}", "prompt": f"{10 + 3 * index}+{21 + 2 * index}=", "chosen": f"<answer>{31 + 5 * index}</answer>",
             "rejected": f"<answer>{32 + 5 * index}</answer>"} for index in range(count)]


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    work = tmp_path_factory.mktemp("compare")
    pairs = work / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in arithmetic_pairs()))
    config = compare.Config(output_dir=str(work / "out"), steps=1, sft_steps=20, sft_round=20, eval_size=16, pairs=str(pairs))
    out = compare.run(config, rows=(ROWS["grpo"], ROWS["rloo"], BROKEN, ROWS["dpo"]))
    return out, json.loads((out / "comparison.json").read_text())


def test_table_rows_in_order_and_a_failing_row_reported_while_the_others_complete(comparison):
    out, table = comparison
    assert [row["name"] for row in table["rows"]] == ["grpo", "rloo", "broken", "dpo"]
    assert [row["status"] for row in table["rows"]] == ["ok", "ok", "failed", "ok"]
    broken = table["rows"][2]
    assert "loss.advantage" in broken["error"] and "nonsense" in broken["error"] and "\n" not in broken["error"]
    assert broken["sets"] == {}
    for row in table["rows"]:
        if row["status"] == "ok":
            assert row["wall_s"] > 0 and row["peak_rss_mib"] > 50  # the child's own RSS: torch alone is more
            assert set(row["sets"]) == set(table["start"]["sets"])
    text = (out / "comparison.md").read_text()
    assert all(f"| {row['label']} |" in text for row in table["rows"]) and "failed: " in text
    assert "What this cannot conclude: one task" in text and "1 steps" in text
    assert (out / "comparison.png").stat().st_size > 1000
    lines = closing_lines(out)
    assert lines[-1].startswith(f"results: {out} ") and "broken failed" in lines[0]


def test_every_gain_is_paired_over_the_start_problems(comparison):
    """Each gain is recomputed from the two eval files, which must hold the same problems in the same order."""
    out, table = comparison
    for row in (row for row in table["rows"] if row["status"] == "ok"):
        for name, result in row["sets"].items():
            suffix = "" if name == "in_distribution" else f"_{name}"
            before = json.loads((out / "eval" / f"eval_start{suffix}.json").read_text())
            after = json.loads((out / "eval" / f"eval_{row['name']}{suffix}.json").read_text())
            assert [r["prompt"] for r in before["rows"]] == [r["prompt"] for r in after["rows"]]
            value, low, high = paired_difference_ci(before["summary"]["correct"], after["summary"]["correct"])
            assert result["gain"] == {"value": value, "ci95": [low, high], "paired": True}
            assert result["n"] == table["start"]["sets"][name]["n"]


KEY_PARTS = {"reward": "reward", "loss.advantage": "advantage estimator", "loss.group": "advantage estimator", "loss.gae": "advantage estimator",
             "loss.reinforce": "advantage estimator", "critic": "advantage estimator", "loss.surrogate": "surrogate",
             "loss.aggregation": "aggregation", "loss.kl": "KL placement", "update": "update", "optim": "optimizer",
             "loss.type": "objective", "loss.nll_weight": "objective", "loss.beta": "objective"}
"""Which part of the loss link a config key belongs to (the first matching prefix)."""
SET_FOR_EVERY_ROW = {"output_dir", "max_steps", "checkpoint_every", "exact_kl_tokens"}
"""Keys the presets differ in that no row trains with: its command sets the first three alike for
every row, and exact_kl_tokens only chooses what is logged (tiny-ppo logs no exact KL)."""


def _flat(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def _config(row):
    settings = {"grpo": online_config.grpo_config, "ppo": online_config.ppo_config, "dpo": dpo_config.Config}[row.command]
    family = (["--data.prompts_per_step", str(compare_samples.PROMPTS_PER_STEP), "--data.group_size", str(compare_samples.GROUP_SIZE)]
              if row.online else ["--data.pairs", "pairs.jsonl"])
    config = build_config(settings, preset(compare.PRESET[row.command]), parse_overrides(["--model", "tiny", *family, *row.flags]))
    return _flat(dataclasses.asdict(config))


@pytest.mark.parametrize("name", [row.name for row in compare.ROWS if row.name not in ("kto", "sft_teacher")])
def test_links_column_names_the_parts_whose_keys_differ_from_the_base(name):
    """Every config key that differs from the family's base row belongs to a part the column names,
    and every named part of the loss has such a key (but the reference, which a loss type drops)."""
    row = ROWS[name]
    base, own = _config(ROWS[compare.BASE[row.command]]), _config(row)
    differing = {key for key in base.keys() | own.keys() if base.get(key) != own.get(key) and key not in SET_FOR_EVERY_ROW}
    parts = {next(part for prefix, part in KEY_PARTS.items() if key == prefix or key.startswith(prefix + ".")) for key in differing}
    named = {part for link, part, _ in row.changed}
    assert parts <= named and named - parts <= {"reference"}, (differing, named)
    assert all(link == ("reward" if part == "reward" else "loss") for link, part, _ in row.changed)


def test_links_rloo_against_grpo():
    assert compare.links_changed(ROWS["grpo"]) == "(the online base)"
    assert compare.links_changed(ROWS["rloo"]) == ("loss: advantage estimator (leave-one-out), KL placement (k1 summed into the reward), "
                                                   "aggregation (seq_mean_token_sum)")
    assert ("data", "unpaired") in {(link, part) for link, part, _ in ROWS["kto"].changed}


def test_bad_rows_value_is_one_line_before_any_work(tmp_path):
    result = subprocess.run([sys.executable, "-m", "posttrain", "compare", "--rows", "grpo,nope", "--output-dir", str(tmp_path / "out")],
                            capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and "no row nope" in result.stderr
    assert "rloo" in result.stderr  # it lists the rows there are
    assert not (tmp_path / "out").exists()


def test_a_start_inside_the_output_directory_is_refused(tmp_path):
    (tmp_path / "out" / "sft").mkdir(parents=True)
    with pytest.raises(compare.UserError, match="lies inside --output-dir"):
        compare.run(compare.Config(output_dir=str(tmp_path / "out"), start=str(tmp_path / "out" / "sft")))


@pytest.mark.parametrize("flags, message", [
    (["--pairs", "{tmp}/nope.jsonl"], "--pairs {tmp}/nope.jsonl: no such file"),
    (["--pairs", "{tmp}/bad.jsonl"], "--pairs {tmp}/bad.jsonl: {tmp}/bad.jsonl:2: rejected: missing field (2 rows read, 1 bad; "),
    (["--pairs", "{tmp}/unpaired.jsonl"], "unpaired rows (KTO's layout: prompt, completion, label), not preference pairs"),
    (["--start", "{tmp}/nope"], "--start {tmp}/nope: no such directory"),
    (["--start", "{tmp}/empty"], "--start {tmp}/empty: neither a model directory (config.json) nor a run directory"),
    (["--start", "{tmp}/broken"], "--start {tmp}/broken: model "),
])
def test_every_input_is_checked_before_any_work(tmp_path, capsys, flags, message):
    """A missing or malformed --pairs, or a --start that does not resolve or load: one line naming the flag, exit 2, before
    the start is trained or scored; no output directory made, and an earlier comparison there kept. (Before, --pairs
    nope.jsonl trained and scored the start first and left a half-filled directory; --start nope left an empty one.)"""
    from posttrain.cli import main

    (tmp_path / "bad.jsonl").write_text(json.dumps(arithmetic_pairs(1)[0]) + "\n" + json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    (tmp_path / "unpaired.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2", "label": True}) + "\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    arguments = [flag.format(tmp=tmp_path) for flag in flags]
    out = tmp_path / "out"
    assert main(["compare", "--output-dir", str(out), "--sft-steps", "1", "--eval-size", "2", "--rows", "dpo", *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(tmp=tmp_path) in err[0], err
    assert not out.exists()
    (out / "earlier").mkdir(parents=True)
    (out / "comparison.json").write_text("{}")
    assert main(["compare", "--output-dir", str(out), "--sft-steps", "1", "--eval-size", "2", "--rows", "dpo", *arguments]) == 2
    assert sorted(path.name for path in out.iterdir()) == ["comparison.json", "earlier"]


# --- the teacher's rows (issue 43): on-policy distillation and SFT on the teacher's samples ---------------

def test_distill_row_is_the_grpo_row_with_the_teacher_as_reward():
    """The distillation row's command is GRPO's (preset, start, budget) with `--reward teacher:<dir>`
    in place of `--reward exact` and `--loss.advantage distill`: the teacher is substituted at run
    time, TEACHER in comparison.json."""
    config = compare.Config(teacher="t")
    grpo = compare.row_command(ROWS["grpo"], "S", "P", Path("D"), config)
    distill = compare.row_command(ROWS["distill"], "S", "P", Path("D"), config, teacher="/models/teacher")
    assert grpo.index("--reward") == grpo.index("exact") - 1
    without_reward = grpo[:grpo.index("--reward")] + grpo[grpo.index("--reward") + 2:]
    assert distill == [*without_reward, "--reward", "teacher:/models/teacher", "--loss.advantage", "distill"]
    assert "teacher:TEACHER" in compare.describe(ROWS["distill"], config)["command"]
    assert compare.links_changed(ROWS["distill"]).startswith("reward: reward (a teacher per token (log p_teacher - log p_student)); "
                                                             "loss: advantage estimator (each token's own teacher reward")


def test_sft_teacher_row_budget_arithmetic():
    """12 steps x 16 prompts x G = 8 = 1536 teacher samples, the distillation row's; SFT holds 8 out
    and takes 32 a step: (1536 - 8) // 32 = 47 steps; a file of 10 rows still trains 1 step."""
    config = compare.Config(steps=12, teacher="t")
    assert compare_samples.teacher_samples(12) == 12 * 16 * 8 == 1536
    assert compare_samples.sft_steps(1536) == 47 and compare_samples.sft_steps(10) == 1
    assert compare.row_steps(ROWS["sft_teacher"], config, None) == 47 and compare.row_steps(ROWS["sft_teacher"], config, 300) == 9
    assert compare.row_steps(ROWS["distill"], config, 300) == 12
    sft_config = build_config(sft.Config, preset("tiny-sft"), {})
    sampling = compare_samples.sampling_arguments("teacher_sft", "/models/teacher", Path("teacher_sft.jsonl"), compare_samples.Sampling(
        config.steps, config.eval_size, config.seed, sft_config.data.task, sft_config.data.task_options, sft_config.acceptance.max_new_tokens))
    assert sampling[:3] == ["pairs", "--model", "/models/teacher"]
    assert sampling[-5:] == ["--sft", "--keep", "all", "--max-rows", "1536"]
    assert sampling[sampling.index("--data.max_prompts") + 1] == "240" and sampling[sampling.index("--group_size") + 1] == "8"  # 192 prompts + a quarter: --max-rows sets the size
    command = compare.row_command(ROWS["sft_teacher"], "S", "F.jsonl", Path("D"), config, "/models/teacher", 47)
    assert command[:3] == ["sft", "--config", "tiny-sft"]
    for flag, value in (("--model", "S"), ("--max-steps", "47"), ("--checkpoint-every", "47"), ("--data.task", "F.jsonl"),
                        ("--data.eval_size", "8"), ("--data.train_size", "1504"), ("--batch_size", "32"), ("--micro_batch_size", "32")):
        assert command[command.index(flag) + 1] == value
    assert compare.links_changed(ROWS["sft_teacher"]).startswith("vs On-policy distillation: data: source (the teacher's samples")


def test_teacher_rows_need_a_teacher(tmp_path, capsys):
    """Selected by --rows without --teacher: one line before any work; by default: left out (logged)."""
    from posttrain.cli import main

    assert [row.name for row in compare.Config().selected() if row.needs_teacher] == []
    assert [row.name for row in compare.Config(teacher="t").selected() if row.needs_teacher] == ["distill_group", "distill", "sft_teacher"]
    out = tmp_path / "out"
    assert main(["compare", "--output-dir", str(out), "--rows", "grpo,sft_teacher"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["posttrain: error: --rows sft_teacher: needs --teacher DIR (a model directory, or a run directory with final/)"], err
    assert main(["compare", "--output-dir", str(out), "--rows", "distill", "--teacher", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--teacher {tmp_path / 'nope'}: no such directory" in err[0], err
    assert not out.exists()


def _tiny_model_directory(directory: Path, seed: int, noise: float) -> Path:
    """The tiny architecture with random weights (`noise` more than build_tiny_model's), saved as a model directory."""
    import torch

    from posttrain.models.tiny import build_tiny_model

    torch.manual_seed(seed)
    model, tokenizer = build_tiny_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(noise * torch.randn_like(parameter))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_teacher_rows_end_to_end(tmp_path):
    """--rows distill,sft_teacher, one step, from a random tiny start with a random tiny teacher (a run
    directory's final/): the teacher sampled once (16 x 8 = 128 rows asked), both rows finish and are
    scored on the start's problems, and the table names the teacher and its pass@1."""
    start = _tiny_model_directory(tmp_path / "start", 0, 0.0)
    teacher = _tiny_model_directory(tmp_path / "teacher-run" / "final", 1, 0.5)
    config = compare.Config(output_dir=str(tmp_path / "out"), rows=("distill", "sft_teacher"), steps=1, eval_size=8,
                            start=str(start), teacher=str(tmp_path / "teacher-run"))
    out = compare.run(config)
    table = json.loads((out / "comparison.json").read_text())
    assert [(row["name"], row["status"]) for row in table["rows"]] == [("distill", "ok"), ("sft_teacher", "ok")], table["rows"]
    assert table["teacher"]["model"] == str(teacher.resolve()) and set(table["teacher"]["sets"]) == set(table["start"]["sets"])
    sampled = table["teacher_sft"]
    assert 0 < sampled["rows"] <= 128 and sampled["keep"] == "all"
    sft_row = table["rows"][1]
    assert sft_row["base"] == "distill" and sft_row["steps"] == compare_samples.sft_steps(sampled["rows"])
    assert (out / "sft_teacher" / "checkpoints" / f"step-{sft_row['steps']:06d}" / "model").is_dir()
    log = (out / "logs" / "distill.log").read_text().splitlines()[0]
    assert f"--reward teacher:{teacher.resolve()}" in log
    text = (out / "comparison.md").read_text()
    assert f"Teacher `{teacher.resolve()}`: held-out pass@1" in text and "| teacher (pass@1) |" in text
