"""`posttrain iterative-dpo` on the tiny model: 2 rounds of (sample from the current policy -> label ->
pairs -> DPO), one run directory. The labeller is `tests.rewards_for_tests.digits` (1 when an answer
holds a digit), which splits an untrained model's samples; the held-out checker is arithmetic's
`integer`. lr 1e-3 so that round 1's end visibly differs from the start model."""

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.recipes import iterative_dpo
from posttrain.runs.faults import RunStopped

ROOT = Path(__file__).resolve().parent.parent
RUN = ["--rounds", "2", "--steps-per-round", "2", "--pairs.data.task", "arithmetic", "--pairs.data.max_prompts", "8",
       "--pairs.data.eval_size", "8", "--pairs.group_size", "4", "--pairs.verifier", "callable:tests.rewards_for_tests.digits",
       "--pairs.sampling.max_new_tokens", "6", "--dpo.batch_size", "4", "--dpo.micro_batch_size", "4", "--dpo.data.heldout_pairs", "0",
       "--dpo.optim.lr", "1e-3", "--dpo.acceptance.max_new_tokens", "6", "--dpo.acceptance.sets", "[]"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 2-round run through the CLI, shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("iterative") / "run"
    result = subprocess.run([sys.executable, "-m", "posttrain", "iterative-dpo", *RUN, "--output-dir", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return out, result


def test_layout_pairs_provenance_and_closing_lines(finished):
    """Each round's pairs and sidecar inside the one run directory, round 2 sampled from round 1's last
    checkpoint; every round's DPO run under rounds/round-K/dpo; the parent's card, metrics, eval, plot and
    the three closing lines; a progress line per round."""
    out, result = finished
    round_1_end = out / "rounds" / "round-1" / "dpo" / "checkpoints" / "step-000002" / "model"
    for number, sampler in ((1, "tiny"), (2, str(round_1_end))):
        round_dir = out / "rounds" / f"round-{number}"
        meta = json.loads((round_dir / "pairs.meta.json").read_text())
        assert meta["model"] == sampler and meta["verifier"] == "callable:tests.rewards_for_tests.digits"
        assert meta["pairs"] == len(rows(round_dir / "pairs.jsonl")) > 0
        assert {row["metadata"]["sampled_from"] for row in rows(round_dir / "pairs.jsonl")} == {sampler}
        assert (round_dir / "dpo" / "checkpoints" / "step-000002" / "model").is_dir()
        assert json.loads((round_dir / "dpo" / "run_card.json").read_text())["run"]["model"] == sampler
        assert f"round {number}/2: sampling 8 prompts x 4 answers from {sampler}" in result.stderr
    # fresh prompts: round 2 drew another seed's training split, so other prompts
    prompts = [{row["prompt"] for row in rows(out / "rounds" / f"round-{n}" / "pairs.jsonl")} for n in (1, 2)]
    assert prompts[0] != prompts[1]
    for name in ("config.yaml", "run_card.json", "run_card.md", "metrics.jsonl", "plots/rounds.png"):
        assert (out / name).is_file(), name
    assert sorted(path.name for path in (out / "eval").iterdir()) == [f"task-step-{step:06d}.json" for step in (0, 2, 4)]
    closing = result.stdout.strip().splitlines()[-3:]
    assert closing[0].startswith("held-out: in_distribution ") and "(step 0) -> " in closing[0] and "(step 4)" in closing[0]
    assert closing[1].startswith("training: loss ")
    assert closing[2] == f"results: {out} (the run card: {out / 'run_card.md'})"


def test_card_per_round_numbers_are_the_eval_files(finished):
    """The card's held-out accuracy after every round (round 0: the start) is each round's eval file's,
    the per-round pairs counts are the sidecars', and the four links say who labelled, which loss and
    which reference."""
    out, _ = finished
    card = json.loads((out / "run_card.json").read_text())
    assert card["run"]["recipe"] == "iterative-dpo" and set(card["links"]) == {"data", "reward", "loss", "acceptance"}
    after = card["links"]["acceptance"]["after_every_round"]
    assert [point["round"] for point in after] == [0, 1, 2] and [point["step"] for point in after] == [0, 2, 4]
    for point in after:
        summary = json.loads(Path(point["eval_file"]).read_text())["summary"]
        assert point["pass@1"] == summary["pass@1"] and point["ci95"] == list(summary["pass@1_ci95"])
        parent = json.loads((out / "eval" / f"task-step-{point['step']:06d}.json").read_text())["summary"]
        assert parent["correct"] == summary["correct"]
    metrics = rows(out / "metrics.jsonl")
    assert [row["heldout/pass@1"] for row in metrics] == [point["pass@1"] for point in after]
    for entry in card["links"]["data"]["rounds"]:
        meta = json.loads((out / "rounds" / f"round-{entry['round']}" / "pairs.meta.json").read_text())
        assert (entry["pairs"], entry["prompts"], entry["sampling_seed"]) == (meta["pairs"], meta["prompts"], meta["seed"])
    assert [row["pairs"] for row in card["rounds"]] == [entry["pairs"] for entry in card["links"]["data"]["rounds"]]
    assert card["links"]["reward"]["labeller"] == "callable:tests.rewards_for_tests.digits"
    assert card["links"]["loss"]["type"] == "sigmoid" and card["links"]["loss"]["reference"].startswith("round_start: ")
    assert card["links"]["acceptance"]["checker"] == "integer" and card["links"]["acceptance"]["independent"] is True
    assert card["results"]["sets"]["in_distribution"]["change"]["paired"] is True
    markdown = (out / "run_card.md").read_text()
    assert "## Rounds" in markdown and markdown.index("## Rounds") < markdown.index("## Results")


def test_round_2_reference_is_round_1s_end(finished):
    """Round 2's DPO reference is round 1's last checkpoint: at its first step the policy still equals
    the reference, so both log-ratios are exactly 0, while round 1 moved the policy away from the start
    model (its last step's log-ratios are not 0: against the start model they would not be 0 either)."""
    out, _ = finished
    first_step = next(row for row in rows(out / "rounds" / "round-2" / "dpo" / "metrics.jsonl") if row["step"] == 1)
    assert (first_step["logratio/chosen"], first_step["logratio/rejected"]) == (0.0, 0.0)
    last_step = next(row for row in rows(out / "rounds" / "round-1" / "dpo" / "metrics.jsonl") if row["step"] == 2)
    assert last_step["logratio/chosen"] != 0.0 and last_step["logratio/rejected"] != 0.0


@pytest.mark.parametrize("overrides, message", [
    (["--dpo.loss.beta", "0"], "dpo.loss.beta must be > 0"),
    (["--dpo.max_steps", "5"], "dpo.max_steps is set by each round (give --steps-per-round)"),
    (["--pairs.model", "tiny"], "pairs.model is set by each round"),
    (["--pairs.group_size", "1"], "pairs.group-size must be at least 2"),
    (["--pairs.verifier", "nosuch"], "pairs.verifier: unknown verifier 'nosuch'"),
    (["--rounds", "0"], "rounds must be at least 1"),
    (["--model", "/no/such/model"], "model '/no/such/model': no such directory"),
    (["--max-steps", "3"], "unknown key 'max_steps'"),
    (["--dpo.data.heldout_pairs", "32"], "dpo.data.heldout_pairs=32 would hold out every pair of a round: a round makes at most 8 "
                                         "(8 prompts x pairs.pairs_per_prompt 1), held out by whole prompts; give at most 7"),
])
def test_bad_config_is_one_line_and_writes_nothing(tmp_path, capsys, overrides, message):
    """The whole config, both nested sections and the verifier included, is checked before anything is written."""
    arguments = [*RUN, "--output-dir", str(tmp_path / "run")]
    for index in range(0, len(overrides), 2):  # replace a value RUN gives, else add it
        if overrides[index] in arguments:
            del arguments[arguments.index(overrides[index]):arguments.index(overrides[index]) + 2]
    assert main(["iterative-dpo", *arguments, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_late_mistake_names_its_key_and_the_command_that_goes_on(tmp_path, capsys):
    """dpo.data.heldout_pairs=7 passes the check before sampling (8 prompts could make 8 pairs) but round 1's
    samples make 7 pairs, all held out: one line naming this recipe's key (dpo.data.heldout_pairs, not DPO's
    data.heldout_pairs) and the command that goes on; that command, with the corrected value, keeps round 1's pairs
    and finishes the run, the change in its card."""
    out = tmp_path / "run"
    arguments = [*RUN, "--output-dir", str(out)]
    arguments[arguments.index("--dpo.data.heldout_pairs") + 1] = "7"
    assert main(["iterative-dpo", *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("posttrain: error: round 1: dpo.data.heldout_pairs=7 leaves no training pairs out of 7; "
                                               "lower it or give dpo.data.heldout_file;"), err
    command = f"posttrain iterative-dpo --resume {out} --resume-changed-config --dpo.data.heldout_pairs VALUE"
    assert err[0].endswith(command), err
    kept = digest(out / "rounds" / "round-1" / "pairs.jsonl")
    assert main(command.replace("VALUE", "0").split()[1:]) == 0
    assert digest(out / "rounds" / "round-1" / "pairs.jsonl") == kept
    card = json.loads((out / "run_card.json").read_text())
    assert card["run"]["resumed_with_changes"] == ["dpo.data.heldout_pairs: 7 -> 0"] and len(card["rounds"]) == 2


def test_a_fresh_run_that_keeps_no_work_leaves_no_directory(tmp_path, capsys):
    """A labeller that scores every answer 0 makes no pair in round 1: its one line, and no run directory left to
    make the corrected command say "already holds a run"; the corrected command then runs in the same directory."""
    out = tmp_path / "run"
    arguments = [*RUN, "--output-dir", str(out), "--rounds", "1"]
    del arguments[arguments.index("--rounds"):arguments.index("--rounds") + 2]
    wrong = [*arguments]
    wrong[wrong.index("--pairs.verifier") + 1] = "callable:tests.rewards_for_tests.zero"
    assert main(["iterative-dpo", *wrong]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "round 1: no pairs: of 8 prompts, 0 had only correct answers, 8 only incorrect" in err[0], err
    assert not out.exists()
    assert main(["iterative-dpo", *arguments]) == 0
    assert (out / "rounds" / "round-1" / "dpo" / "checkpoints" / "step-000002" / "model").is_dir()


def test_a_stopped_round_says_the_parents_resume(tmp_path, monkeypatch, capsys):
    """A round's DPO run stopped by SIGTERM at its step 1 (as `runs/skeleton.StepLoop` stops it): the line says the
    command that goes on with the whole run (posttrain iterative-dpo --resume DIR), not the round's own `posttrain dpo`
    run, at the step counted over all rounds; exit 128 + 15."""
    out = tmp_path / "run"

    def stopped(config, resume=False, resume_changed_config=False):
        raise RunStopped(signal.SIGTERM, 1, f"posttrain dpo --resume {config.output_dir}")

    monkeypatch.setattr(iterative_dpo.dpo, "run", stopped)
    assert main(["iterative-dpo", *RUN, "--output-dir", str(out)]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"posttrain: stopped by SIGTERM at step 1; resume with: posttrain iterative-dpo --resume {out}"], err
    assert (out / "rounds" / "round-1" / "pairs.meta.json").is_file()


def test_resume_skips_the_completed_round(finished, tmp_path, caplog, capsys):
    """A copy of the finished run with round 2 gone (as if stopped after round 1): --resume skips round 1
    (its files untouched), samples round 2 again from round 1's end, the same pairs as before (seeded), and
    ends with the same card numbers; a finished run is refused in one line; a third round is added with
    --resume-changed-config --rounds 3 (sampled from round 2's end, the change in the card)."""
    original, _ = finished
    out = tmp_path / "run"
    shutil.copytree(original, out)
    shutil.rmtree(out / "rounds" / "round-2")
    kept = {path: digest(path) for path in (out / "rounds" / "round-1").rglob("*") if path.is_file()}
    with caplog.at_level("INFO", logger="posttrain.recipes.iterative_dpo"):
        assert main(["iterative-dpo", "--resume", str(out)]) == 0
    assert "round 1/2: complete (its DPO run finished), skipped" in caplog.messages
    assert {path: digest(path) for path in kept} == kept
    pairs = [[(row["prompt"], row["chosen"], row["rejected"]) for row in rows(run / "rounds" / "round-2" / "pairs.jsonl")] for run in (original, out)]
    assert pairs[0] == pairs[1]
    before, after = (json.loads((run / "run_card.json").read_text())["links"]["acceptance"]["after_every_round"] for run in (original, out))
    assert [point["pass@1"] for point in after] == [point["pass@1"] for point in before]
    capsys.readouterr()
    assert main(["iterative-dpo", "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out}: finished: all 2 rounds are complete" in err[0], err
    assert main(["iterative-dpo", "--resume", str(out), "--resume-changed-config", "--rounds", "3"]) == 0
    meta = json.loads((out / "rounds" / "round-3" / "pairs.meta.json").read_text())
    assert meta["model"] == str(out / "rounds" / "round-2" / "dpo" / "checkpoints" / "step-000002" / "model")
    card = json.loads((out / "run_card.json").read_text())
    assert card["run"]["resumed_with_changes"] == ["rounds: 2 -> 3"] and len(card["rounds"]) == 3
    held_out = capsys.readouterr().out.strip().splitlines()[-3]
    assert held_out.startswith("held-out: in_distribution ") and "(step 0) -> " in held_out and "(step 6)" in held_out


def test_iterative_kto_rounds_on_unpaired_rows(tmp_path):
    """`--pairs.unpaired true --dpo.loss.type kto`: each round writes KTO's unpaired rows of the current
    policy's samples and trains KTO on them; the card's rounds count the rows. Unpaired rows with a
    pairwise loss are one line before any work."""
    out = tmp_path / "run"
    one_round = list(RUN)
    one_round[one_round.index("--rounds") + 1] = "1"
    held = list(one_round)
    held[held.index("--dpo.data.heldout_pairs") + 1] = "4"
    result = subprocess.run([sys.executable, "-m", "posttrain", "iterative-dpo", *held, "--pairs.unpaired", "true",
                             "--dpo.loss.type", "kto", "--output-dir", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    meta = json.loads((out / "rounds" / "round-1" / "pairs.meta.json").read_text())
    written = rows(out / "rounds" / "round-1" / "pairs.jsonl")
    assert meta["unpaired"] is True and meta["rows"] == len(written) > 0 and {"completion", "label"} <= set(written[0])
    card = json.loads((out / "run_card.json").read_text())
    assert card["rounds"][-1]["pairs"] == meta["rows"]
    accuracy = card["rounds"][-1]["heldout_accuracy"]  # KTO's held-out rate is named for what it is, never None
    assert accuracy["metric"] == "heldout/label_side_accuracy" and 0 <= accuracy["value"] <= 1
    assert accuracy["ci95"][0] <= accuracy["value"] <= accuracy["ci95"][1] and accuracy["ties"] is not None
    assert json.loads((out / "rounds" / "round-1" / "dpo" / "run_card.json").read_text())["links"]["loss"]["type"] == "kto"
    refused = subprocess.run([sys.executable, "-m", "posttrain", "iterative-dpo", *one_round, "--pairs.unpaired", "true",
                              "--output-dir", str(tmp_path / "refused")], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 2 and "pairs.unpaired writes KTO's unpaired rows" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "refused").exists()
