"""The common mistakes of issue 27, each as the user typed it: the exit code, the one line on
stderr, and nothing written or overwritten."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import main

POSTTRAIN = str(Path(sys.executable).parent / "posttrain")
"""The installed `posttrain` script: unlike `python -m posttrain`, it does not put the current
directory on the import path by itself."""
SMALL_ONLINE = ["--max-steps", "1", "--data.eval_size", "8", "--data.train_size", "50", "--data.prompts_per_step", "2",
                "--data.group_size", "2", "--sampling.max_new_tokens", "4"]
MY_REWARD = "def score(completion, example):\n    return float(any(c.isdigit() for c in completion))\n"


def one_error_line(capsys) -> str:
    """The one line a refused command printed on stderr (log lines of its start aside)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("posttrain: ", "posttrain grpo: "))]
    assert len(lines) == 1, lines
    return lines[0]


# --- item 4: --reward callable: -------------------------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["grpo", "--reward", "callable:my_rewards.nope", *SMALL_ONLINE],
    ["ppo", "--reward", "callable:my_rewards.nope", *SMALL_ONLINE],
    ["pairs", "--model", "tiny", "--data.task", "arithmetic", "--verifier", "callable:my_rewards.nope"],
], ids=lambda argv: argv[0])
def test_a_callable_path_that_does_not_import_is_one_line(argv, tmp_path, monkeypatch, capsys):
    """grpo, ppo and pairs as verify does: one line naming the path, the reason and where modules
    are looked for; no run directory, no pairs file."""
    monkeypatch.chdir(tmp_path)
    output = ["--out", str(tmp_path / "pairs.jsonl")] if argv[0] == "pairs" else ["--output-dir", str(tmp_path / "run")]
    assert main(argv + output) == 2
    setting = "--verifier" if argv[0] == "pairs" else "reward"
    assert one_error_line(capsys) == (
        f"posttrain: error: {setting}: cannot load callable:my_rewards.nope: ModuleNotFoundError: No module named "
        f"'my_rewards' (modules are imported from the current directory, {tmp_path}, then PYTHONPATH)")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_a_missing_function_of_a_module_in_the_current_directory_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards.py").write_text(MY_REWARD)
    monkeypatch.chdir(tmp_path)
    assert main(["grpo", "--reward", "callable:my_rewards.scor", *SMALL_ONLINE, "--output-dir", "run"]) == 2
    assert one_error_line(capsys) == (
        "posttrain: error: reward: cannot load callable:my_rewards.scor: AttributeError: module 'my_rewards' has no "
        f"attribute 'scor' (modules are imported from the current directory, {tmp_path}, then PYTHONPATH)")
    assert not (tmp_path / "run").exists()


def test_the_posttrain_script_imports_a_reward_module_from_the_current_directory(tmp_path):
    """`posttrain grpo --reward callable:my_rewards.score` run where my_rewards.py is, without
    PYTHONPATH: the run trains and scores with it (the trainer checks the path, its workers score)."""
    (tmp_path / "my_rewards.py").write_text(MY_REWARD)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([POSTTRAIN, "grpo", "--reward", "callable:my_rewards.score", *SMALL_ONLINE, "--output-dir", "run"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "results: run (the run card: run/run_card.md)"
    assert "training reward callable:my_rewards.score" in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()


# --- item 7: output paths ---------------------------------------------------------------------------

PAIRS = ["pairs", "--model", "tiny", "--data.task", "arithmetic", "--group-size", "2", "--data.max_prompts", "4",
         "--data.eval_size", "4", "--max-new-tokens", "4", "--verifier", "callable:tests.rewards_for_tests.digits"]


@pytest.fixture
def no_sampling(monkeypatch):
    """Sampling fails the test: an output path is refused before any."""
    def sampled(*args, **kwargs):
        raise AssertionError("sampled before refusing the output path")
    monkeypatch.setattr("posttrain.recipes.pairs.make_engine", lambda settings: sampled)


@pytest.mark.parametrize("argv", [["grpo", *SMALL_ONLINE], ["sft", "--max-steps", "1"], ["demo"],
                                  ["eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "4"]],
                         ids=lambda argv: argv[0])
def test_an_output_dir_that_is_a_file_is_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("mine\n")
    assert main(argv + ["--output-dir", "afile"]) == 2
    assert one_error_line(capsys) == "posttrain: error: --output-dir afile: is a file, not a directory"
    assert main(argv + ["--output-dir", "afile/run"]) == 2
    assert one_error_line(capsys) == "posttrain: error: --output-dir afile/run: afile is a file, not a directory"
    assert Path("afile").read_text() == "mine\n" and sorted(os.listdir()) == ["afile"]


def test_a_run_or_eval_refuses_a_non_empty_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("notes").mkdir()
    Path("notes/todo.txt").write_text("mine\n")
    assert main(["sft", "--max-steps", "1", "--output-dir", "notes"]) == 2
    assert one_error_line(capsys) == ("posttrain: error: --output-dir notes: not empty (a run starts in a new or empty "
                                      "directory); choose another --output-dir")
    assert main(["eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "4", "--output-dir", "notes"]) == 2
    assert one_error_line(capsys) == ("posttrain: error: --output-dir notes: not empty; pass --overwrite to replace its "
                                      "eval.json and summary.json, or choose another --output-dir")
    assert os.listdir("notes") == ["todo.txt"]


def test_pairs_out_under_a_file_is_refused_before_sampling(tmp_path, monkeypatch, capsys, no_sampling):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("mine\n")
    assert main(PAIRS + ["--out", "afile/x.jsonl"]) == 2
    assert one_error_line(capsys) == "posttrain: error: --out afile/x.jsonl: afile is a file, not a directory"
    assert Path("afile").read_text() == "mine\n" and sorted(os.listdir()) == ["afile"]


def test_pairs_out_onto_an_existing_file_is_refused_unless_overwrite(tmp_path, monkeypatch, capsys):
    """The first run writes pairs.jsonl and its sidecar; the same command again is refused before
    sampling, both files untouched; with --overwrite it replaces them."""
    monkeypatch.chdir(tmp_path)
    assert main(PAIRS + ["--out", "pairs.jsonl"]) == 0
    capsys.readouterr()
    first = {name: Path(name).read_bytes() for name in ("pairs.jsonl", "pairs.meta.json")}
    with monkeypatch.context() as patch:
        patch.setattr("posttrain.recipes.pairs.make_engine", lambda settings: lambda *a, **k: pytest.fail("sampled before refusing --out"))
        assert main(PAIRS + ["--out", "pairs.jsonl"]) == 2
        assert one_error_line(capsys) == ("posttrain: error: --out pairs.jsonl: already exists; pass --overwrite to "
                                          "replace it, or choose another --out")
        Path("pairs.jsonl").unlink()
        Path("kept.jsonl").write_bytes(first["pairs.jsonl"])
        assert main(PAIRS + ["--out", "pairs.jsonl"]) == 2  # the sidecar alone is somebody's too
        assert one_error_line(capsys) == ("posttrain: error: --out pairs.jsonl: its sidecar pairs.meta.json already exists; "
                                          "pass --overwrite to replace both, or choose another --out")
    Path("kept.jsonl").rename("pairs.jsonl")
    assert {name: Path(name).read_bytes() for name in first} == first
    assert main(PAIRS + ["--out", "pairs.jsonl", "--seed", "1", "--overwrite"]) == 0
    assert "wrote pairs.jsonl and pairs.meta.json" in capsys.readouterr().out
    assert json.loads(Path("pairs.meta.json").read_text())["seed"] == 1


def test_verify_output_onto_an_existing_file_is_refused_unless_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("rows.jsonl").write_text('{"completion": "<answer>4</answer>", "answer": "4"}\n')
    Path("verdicts.jsonl").write_text("mine\n")
    assert main(["verify", "--verifier", "exact", "--input", "rows.jsonl", "--output", "verdicts.jsonl"]) == 2
    assert one_error_line(capsys) == ("posttrain: error: --output verdicts.jsonl: already exists; pass --overwrite to "
                                      "replace it, or choose another --output")
    assert Path("verdicts.jsonl").read_text() == "mine\n"
    assert main(["verify", "--verifier", "exact", "--input", "rows.jsonl", "--output", "verdicts.jsonl", "--overwrite"]) == 0
    assert json.loads(Path("verdicts.jsonl").read_text())["reward"] == 1.0


# --- item 10: resume surprises --------------------------------------------------------------------

SMALL_SFT = ["--data.train_size", "16", "--data.eval_size", "4", "--batch_size", "4", "--micro_batch_size", "2",
             "--acceptance.max_new_tokens", "4", "--acceptance.sets", "[]", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def finished_sft_run(tmp_path_factory):
    """An SFT run of 4 steps, finished (checkpoints at steps 2 and 4)."""
    run = tmp_path_factory.mktemp("resume") / "run"
    assert main(["sft", *SMALL_SFT, "--max-steps", "4", "--output-dir", str(run)]) == 0
    return run


def run_files(run: Path) -> dict[str, bytes]:
    """Every file of a run directory, for "nothing was rewritten" (config.yaml, card, logs, checkpoints)."""
    return {str(path.relative_to(run)): path.read_bytes() for path in sorted(run.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("argv, message", [
    (["sft", "--output-dir", "{other}"],
     "posttrain: error: --resume {run} continues the run in {run}; --output-dir {other} names another directory: give one of them"),
    (["sft", "--max-steps", "3"],
     "posttrain: error: {run}: finished: its newest checkpoint is step 4 and max_steps is 3, so there is nothing to resume "
     "(--max-steps counts all the run's steps: --max-steps 5 or more trains on)"),
    (["sft"],
     "posttrain: error: {run}: finished: its newest checkpoint is step 4 and max_steps is 4, so there is nothing to resume "
     "(--max-steps counts all the run's steps: --max-steps 5 or more trains on)"),
    (["grpo"], "posttrain: error: {run} is a sft run; resume it with: posttrain sft --resume {run}"),
    (["ppo", "--max-steps", "6"], "posttrain: error: {run} is a sft run; resume it with: posttrain sft --resume {run}"),
], ids=["output-dir", "max-steps-below", "finished", "grpo", "ppo"])
def test_a_resume_that_would_do_nothing_or_the_wrong_thing_is_one_line(argv, message, finished_sft_run, tmp_path, capsys):
    """--resume DIR with another --output-dir, with a --max-steps the run has reached, or under
    another recipe's command: one line, the run's files (config.yaml included) byte for byte as they
    were, and no other directory made."""
    other = tmp_path / "other"
    before = run_files(finished_sft_run)
    argv = [arg.format(other=other) for arg in argv]
    assert main([argv[0], "--resume", str(finished_sft_run), *argv[1:]]) == 2
    assert one_error_line(capsys) == message.format(run=finished_sft_run, other=other)
    assert run_files(finished_sft_run) == before
    assert not other.exists()


def test_a_resume_with_its_own_output_dir_and_more_steps_trains_on(finished_sft_run, tmp_path, capsys):
    """The same directory named twice is no conflict, and --max-steps past the newest step trains on."""
    run = tmp_path / "copy"
    shutil.copytree(finished_sft_run, run)
    assert main(["sft", "--resume", str(run), "--output-dir", str(run), "--max-steps", "5"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"results: {run} (the run card: {run / 'run_card.md'})"
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 5


def test_the_python_api_refuses_to_resume_a_finished_run_too(finished_sft_run):
    """`sft.run(config, resume=True)` asks in `open_run`, before config.yaml is written."""
    from posttrain.config import build_config
    from posttrain.errors import UserError
    from posttrain.recipes import sft

    before = run_files(finished_sft_run)
    config = build_config(sft.Config, finished_sft_run / "config.yaml")
    with pytest.raises(UserError, match=r": finished: its newest checkpoint is step 4 and max_steps is 4, so there is nothing"):
        sft.run(config, resume=True)
    assert run_files(finished_sft_run) == before


# --- item 11 (parts): report_to, micro_batch_size, repeated flags, presets, docs --------------------

def test_report_to_takes_one_name_or_a_comma_list_as_hugging_face_does():
    from posttrain.config import build_config, parse_overrides
    from posttrain.recipes import sft

    def report_to(*argv):
        return build_config(sft.Config, None, parse_overrides(list(argv), once=True)).report_to

    assert report_to("--report_to", "wandb") == ["wandb"]
    assert report_to("--report_to", "wandb,mlflow") == ["wandb", "mlflow"]
    assert report_to("--report_to", "[tensorboard, trackio]") == ["tensorboard", "trackio"]
    assert report_to("--report_to", "none") == [] and report_to() == []


def test_sft_batch_size_alone_sets_the_micro_batch_and_both_are_recorded(tmp_path, monkeypatch, capsys):
    """`posttrain sft --batch_size 4 --report_to tensorboard`: micro_batch_size follows batch_size (it
    was 32 and refused 4); config.yaml and the run card hold the resolved numbers and the tracker list."""
    import yaml

    monkeypatch.chdir(tmp_path)
    assert main(["sft", "--batch_size", "4", "--report_to", "tensorboard", "--max-steps", "1", "--data.train_size", "8",
                 "--data.eval_size", "4", "--acceptance.max_new_tokens", "4", "--acceptance.sets", "[]", "--output-dir", "run"]) == 0
    saved = yaml.safe_load(Path("run/config.yaml").read_text())
    card = json.loads(Path("run/run_card.json").read_text())["run"]["config"]
    assert (saved["batch_size"], saved["micro_batch_size"], saved["report_to"]) == (4, 4, ["tensorboard"])
    assert (card["batch_size"], card["micro_batch_size"], card["report_to"]) == (4, 4, ["tensorboard"])
    assert any(Path("run/tensorboard").iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "2", "--max_steps", "1"], "posttrain: error: --max-steps 2 and --max_steps 1 set the same key; give it once"),
    (["--optim.lr", "1e-3", "--optim.lr=1e-2"], "posttrain: error: --optim.lr 1e-3 and --optim.lr 1e-2 set the same key; give it once"),
    (["--max-steps", "2", "--max-steps", "1"],
     "posttrain grpo: error: argument --max-steps: given twice (2, then 1); give it once (see --help)"),
], ids=["two-spellings", "override-twice", "flag-twice"])
def test_a_key_given_twice_is_refused(argv, message, tmp_path, capsys):
    try:
        code = main(["grpo", *argv, "--output-dir", str(tmp_path / "run")])
    except SystemExit as stop:  # argparse's own error: its one line, exit 2
        code = stop.code
    assert code == 2
    assert one_error_line(capsys) == message
    assert not (tmp_path / "run").exists()


def test_a_preset_is_found_by_name_from_any_directory(tmp_path, monkeypatch, capsys):
    """Outside the repository `--config tiny-sft` reads the shipped preset; `presets/tiny-grpo.yaml`
    there is one line saying how to name it and where the presets are."""
    from posttrain.config import PRESETS, build_config
    from posttrain.recipes import sft

    monkeypatch.chdir(tmp_path)
    assert build_config(sft.Config, "tiny-sft").max_steps == 600
    assert main(["grpo", "--config", "presets/tiny-grpo.yaml", "--output-dir", "run"]) == 2
    assert one_error_line(capsys) == ("posttrain: error: presets/tiny-grpo.yaml: config file not found (a preset shipped with "
                                      f"posttrain is named by itself, e.g. --config tiny-grpo: it is in {PRESETS})")
    assert main(["grpo", "--config", "my-grpo.yaml", "--output-dir", "run"]) == 2
    shipped = sorted(path.stem for path in PRESETS.glob("*.yaml"))
    assert {"smollm2-grpo", "tiny-dpo", "tiny-grpo", "tiny-sft"} <= set(shipped)
    assert one_error_line(capsys) == (
        f"posttrain: error: my-grpo.yaml: config file not found; the presets shipped with posttrain, by name: {', '.join(shipped)} (in {PRESETS})")
    assert os.listdir() == []


def test_the_presets_are_package_data():
    """posttrain/presets is the repository's presets/ (a link), and the wheel ships its YAML files."""
    import tomllib

    from posttrain.config import PRESETS

    root = Path(__file__).resolve().parent.parent
    assert PRESETS.resolve() == (root / "presets").resolve()
    assert sorted(path.name for path in PRESETS.glob("*.yaml")) == sorted(path.name for path in (root / "presets").glob("*.yaml"))
    package_data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert package_data["posttrain"] == ["presets/*.yaml"]


def test_the_docs_name_no_file_a_user_lacks_and_eval_examples_say_where_results_go():
    """No DESIGN.md or "the seed('s)" (a document users do not have) in the docs, README or presets;
    every `posttrain eval` command in them has --output-dir (required)."""
    import re

    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "presets").glob("*.yaml"))]
    for page in pages:
        text = page.read_text()
        assert "DESIGN.md" not in text and not re.search(r"\b[Tt]he seed\b(?! for all rows)", text), page.name
        commands = re.findall(r"^\s*(?:#\s*)?posttrain eval (.*(?:\\\n.*)*)", text, flags=re.M)
        assert all("--output-dir" in command for command in commands), (page.name, commands)


# --- issue 40, item 12: the obvious spellings ---------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["grpo", "--tools", "[add]"], "'tools' is a section, not a value; did you mean --tools.names '[add]'?"),
    (["grpo", "--tools", "add"], "'tools' is a section, not a value; did you mean --tools.names add?"),
    (["dpo", "--loss", "kto"], "'loss' is a section, not a value; did you mean --loss.type kto?"),
    (["grpo", "--loss", "rloo"], "'loss' is a section, not a value; did you mean --loss.advantage rloo?"),
    (["ppo", "--loss", "gspo"], "'loss' is a section, not a value; did you mean --loss.surrogate gspo?"),
    (["grpo", "--loss", "kto"], "'loss' is a section, not a value; set its keys, e.g. --loss.advantage "
                                "group|gae|rloo|reinforce_pp|reinforce_pp_baseline|distill or --loss.surrogate clip|gspo|cispo|clip_cov|kl_cov"),
    (["iterative-dpo", "--dpo.loss", "kto"], "'dpo.loss' is a section, not a value; did you mean --dpo.loss.type kto?"),
    (["sft", "--data", "my.jsonl"], "'data' is a section, not a value; did you mean --data.task my.jsonl?"),
    (["grpo", "--hardware", "cuda"], "'hardware' is a section, not a value; did you mean --hardware.device cuda?"),
    (["grpo", "--hardware", "bf16"], "'hardware' is a section, not a value; did you mean --hardware.precision bf16?"),
    (["eval", "--rollout", "vllm"], "'rollout' is a section, not a value; did you mean --rollout.engine vllm?"),
    (["grpo", "--critic", "3"], "'critic' is a section; give a mapping of its keys"),  # no main key: nothing to guess
], ids=lambda value: " ".join(value) if isinstance(value, list) else "")
def test_a_value_given_to_a_section_names_the_key_it_meant(argv, message, tmp_path, capsys):
    """Each section's PRIMARY table: the first main key that takes the value (a Literal's or a
    table's names, else the key's type), or the main keys and their names when none does."""
    output = ["--output-dir", str(tmp_path / "run")]
    assert main(argv + output) == 2
    assert one_error_line(capsys) == f"posttrain: error: command line: {message}"
    assert not (tmp_path / "run").exists()


def test_a_value_given_to_a_section_in_a_yaml_file_is_spelled_as_yaml(tmp_path, capsys):
    (tmp_path / "mine.yaml").write_text("tools: [add, calculator]\n")
    assert main(["grpo", "--config", str(tmp_path / "mine.yaml"), "--output-dir", str(tmp_path / "run")]) == 2
    assert one_error_line(capsys) == (f"posttrain: error: {tmp_path / 'mine.yaml'}: 'tools' is a section, not a value; "
                                      "did you mean tools: {names: [add, calculator]}?")


def test_a_list_of_strings_takes_a_comma_list_as_report_to_does():
    """`--tools.names add,calculator` (was: "expected a list") as `--report_to wandb,mlflow`; one name is
    a list of one; report_to (a list or a string) keeps `none` meaning no tracker."""
    from posttrain.config import build_config, parse_overrides
    from posttrain.recipes.online_config import grpo_config

    def config(*argv):
        return build_config(grpo_config, None, parse_overrides(list(argv), once=True))

    assert config("--tools.names", "add,calculator").tools.names == ["add", "calculator"]
    assert config("--tools.names", "add, calculator").tools.names == ["add", "calculator"]
    assert config("--tools.names", "add").tools.names == ["add"]
    assert config("--tools.names", "[add, calculator]").tools.names == ["add", "calculator"]
    assert config("--report_to", "none").report_to == [] and config("--report_to", "tensorboard,mlflow").report_to == ["tensorboard", "mlflow"]


def test_a_judge_that_cannot_load_says_it_is_the_judge(tmp_path, capsys):
    """`--reward judge:./missing` and `pairs --labeller judge:./missing`: the line names the judge
    (was "model './missing': no such directory", which reads as the policy)."""
    assert main(["grpo", *SMALL_ONLINE, "--reward", "judge:./missing", "--output-dir", str(tmp_path / "run")]) == 2
    assert one_error_line(capsys) == "posttrain: error: judge:./missing: the judge model './missing': no such directory"
    assert main([*PAIRS[:-2], "--labeller", "judge:./missing", "--out", str(tmp_path / "pairs.jsonl")]) == 2
    assert one_error_line(capsys) == "posttrain: error: judge:./missing: the judge model './missing': no such directory"
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_the_readme_and_docs_name_presets_as_posttrain_ships_them():
    """Every `--config` of a command in the README and the docs is a shipped preset's bare name or the
    user's own YAML file (`my-grpo.yaml`), never `presets/tiny-grpo.yaml`: a path into the repository,
    which a user who installed posttrain lacks."""
    import re

    from posttrain.config import PRESETS

    root = Path(__file__).resolve().parent.parent
    shipped = {path.stem for path in PRESETS.glob("*.yaml")}
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for name in re.findall(r"posttrain [\w-]+ .*?--config (\S+)", page.read_text()):
            name = name.strip("`'\"")
            assert not name.startswith("presets/") and (name in shipped or name.endswith(".yaml")), (page.name, name)

# --- issue 40, item 2: prompts longer than the model ------------------------------------------------

def test_a_shifted_held_out_set_past_the_models_positions_is_refused_before_any_work(tmp_path, capsys):
    """The tiny model has 1,024 positions. With 996 tokens for each held-out answer, the in-distribution
    prompts ("59+46=", 25 tokens) and digits_3 ("325+226=", 27) fit; the `words` set ("38 plus 25 =",
    31 tokens) needs 1,027: one line naming that set, before any sampling, and no run directory."""
    import re

    argv = ["grpo", *SMALL_ONLINE, "--acceptance.max_new_tokens", "996", "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert re.fullmatch(
        r"posttrain: error: the longest held-out 'words' prompt \(example arithmetic-eval-\d+\) is 31 tokens, and with "
        r"acceptance.max_new_tokens 996 it needs 1,027 positions, more than the model's 1,024 \(max_position_embeddings\); "
        r"they go to the answer 996, the prompt itself 31: lower acceptance.max_new_tokens to 993 at most", one_error_line(capsys))
    assert not (tmp_path / "run").exists()


def test_pairs_refuses_prompts_past_the_models_positions_before_sampling(tmp_path, capsys):
    """A system prompt of 1,000 characters on the tiny model (one token each): 1,025 + 4 > 1,024."""
    import re

    out = tmp_path / "pairs.jsonl"
    assert main([*PAIRS, "--data.system_prompt", "x" * 1000, "--out", str(out)]) == 2
    assert re.fullmatch(
        r"posttrain: error: the longest training prompt \(example arithmetic-train-\d+\) is 1,035 tokens, and with "
        r"sampling.max_new_tokens 4 it needs 1,039 positions, more than the model's 1,024 \(max_position_embeddings\); "
        r"they go to data.system_prompt 1,010, the prompt itself 25, the answer 4: shorten data.system_prompt", one_error_line(capsys))
    assert not out.exists()


def test_sft_and_dpo_refuse_held_out_prompts_past_the_models_positions(tmp_path, capsys):
    """SFT's and DPO's held-out evaluations sample too: "59+46=" prompts (25 tokens) with 1,000 new
    tokens need more than the tiny model's 1,024 positions: one line naming acceptance.max_new_tokens,
    before any step, and no run directory."""
    from tests.test_dpo import arithmetic_pairs, write_pairs

    sft = list(SMALL_SFT)
    sft[sft.index("--acceptance.max_new_tokens") + 1] = "1000"
    assert main(["sft", *sft, "--max-steps", "1", "--output-dir", str(tmp_path / "sft")]) == 2
    line = one_error_line(capsys)
    assert "held-out prompt" in line and "acceptance.max_new_tokens 1000" in line and "more than the model's 1,024" in line
    assert not (tmp_path / "sft").exists()
    pairs = write_pairs(tmp_path / "pairs.jsonl", arithmetic_pairs())
    assert main(["dpo", "--data.pairs", str(pairs), "--data.heldout_pairs", "2", "--acceptance.task", "arithmetic",
                 "--acceptance.eval_size", "8", "--acceptance.max_new_tokens", "1000", "--max-steps", "1",
                 "--output-dir", str(tmp_path / "dpo")]) == 2
    line = one_error_line(capsys)
    assert "held-out prompt" in line and "acceptance.max_new_tokens 1000" in line and "more than the model's 1,024" in line
    assert not (tmp_path / "dpo").exists()
