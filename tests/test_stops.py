"""What ends a run early: SIGTERM / SIGINT (checkpoint at the step, one line, resume is exact), memory
running out in each phase (one line naming the phase and its settings), a resume with no complete
checkpoint (a clean log), a resume with a changed config (refused, or accepted and recorded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from posttrain.config import build_config
from posttrain.errors import UserError
from posttrain.recipes import dpo, online, online_config, sft
from posttrain.runs.faults import RunStopped, config_changes

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "tiny", "--data.prompts_per_step", "4", "--data.group_size", "2", "--data.eval_size", "8",
         "--sampling.max_new_tokens", "6", "--acceptance.sets", "[]"]


def _cli(*extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OMP_NUM_THREADS": "1"}
    return [sys.executable, "-m", "posttrain", "grpo", *SMALL, "--reward", "callable:rewards_for_tests.digits", "--seed", "5",
            *extra], env


def _comparable(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("seconds/", "tokens_per_second"))} for row in rows]


def test_sigterm_checkpoints_at_the_step_and_resume_is_exact(tmp_path):
    """SIGTERM mid-run: the step in progress finishes, a checkpoint is written at that step (though
    checkpoint_every is 100), the last stderr line says where to resume, exit 143; the resumed run's
    metrics and weights equal an uninterrupted run's."""
    from posttrain.models import load_model

    straight, env = _cli("--output-dir", str(tmp_path / "straight"), "--max-steps", "4", "--checkpoint-every", "100")
    subprocess.run(straight, env=env, check=True, capture_output=True, cwd=ROOT)
    stopped = tmp_path / "stopped"
    command, env = _cli("--output-dir", str(stopped), "--max-steps", "4", "--checkpoint-every", "100")
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and not any('"step": 1' in line for line in _lines(stopped / "metrics.jsonl")):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=300)[1]
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    step = len(_lines(stopped / "metrics.jsonl")) - 1  # rows 0..N
    assert 1 <= step < 4
    assert stderr.strip().splitlines()[-1] == f"posttrain: stopped by SIGTERM at step {step}; resume with: posttrain grpo --resume {stopped}"
    assert [p.name for p in (stopped / "checkpoints").glob("step-*")] == [f"step-{step:06d}"]
    resume, env = [sys.executable, "-m", "posttrain", "grpo", "--resume", str(stopped)], _cli()[1]
    result = subprocess.run(resume, env=env, capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert _comparable(stopped) == _comparable(tmp_path / "straight")
    final_a = load_model(str(tmp_path / "straight" / "checkpoints" / "step-000004" / "model"))[0]
    final_b = load_model(str(stopped / "checkpoints" / "step-000004" / "model"))[0]
    for (name, a), (_, b) in zip(final_a.named_parameters(), final_b.named_parameters()):
        assert torch.equal(a, b), name


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def test_a_second_signal_stops_at_once_and_handlers_are_restored():
    """The first SIGTERM is noted (the process goes on); the second kills it at once, as SIGTERM's
    default action does. Leaving the block restores the handlers that were there before."""
    script = ("import os, signal, time\n"
              "from posttrain.runs.faults import StopSignals\n"
              "before = signal.getsignal(signal.SIGINT)\n"
              "with StopSignals() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n"
              "    assert stop.requested == signal.SIGINT and stop.agreed() == signal.SIGINT\n"
              "assert signal.getsignal(signal.SIGINT) is before\n"
              "print('noted', flush=True)\n"
              "with StopSignals() as stop:\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    print('first', flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(5)\n"
              "    print('never', flush=True)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout.split() == ["noted", "first"]


def test_run_stopped_message_and_status():
    error = RunStopped(signal.SIGTERM, 7, "posttrain sft --resume runs/x")
    assert str(error) == "stopped by SIGTERM at step 7; resume with: posttrain sft --resume runs/x"
    assert error.exit_code == 143 and RunStopped(signal.SIGINT, 1, "").exit_code == 130


def _grpo(tmp_path, **overrides):
    base = {"model": "tiny", "output_dir": str(tmp_path / "run"), "max_steps": 2, "checkpoint_every": 1,
            "data": {"prompts_per_step": 2, "group_size": 2, "eval_size": 4}, "sampling": {"max_new_tokens": 4},
            "acceptance": {"sets": []}}
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return build_config(online_config.grpo_config, None, base)


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.mark.parametrize("target, phase, knob, extra", [
    ("posttrain.rollout.sampler.single_turn.generate", "generation", "sampling.max_new_tokens", []),
    ("posttrain.losses.policy_gradient.rank_logprobs", "reference", "update.micro_batch_size", ["--loss.kl.beta", "0.05"]),
    ("posttrain.recipes.online.loss_step", "update", "memory.gradient_checkpointing", []),
    ("posttrain.evaluation.acceptance.evaluate_task", "evaluation", "acceptance.max_new_tokens", []),
])
def test_out_of_memory_in_each_online_phase_is_one_line(tmp_path, monkeypatch, capsys, target, phase, knob, extra):
    """A simulated CUDA out-of-memory in each phase of a grpo run: exit 3, one stderr line with the
    step, the phase and the settings that shrink it; no traceback; the run directory resumable."""
    from posttrain.cli import main

    if phase == "generation":  # the held-out evaluation samples through the same engine, one answer per problem
        from posttrain.rollout import sampler

        real = sampler.single_turn.generate  # the built-in engine the default sampler draws with
        monkeypatch.setattr(target, lambda *a, **k: _oom() if k.get("group_size", 1) > 1 else real(*a, **k))
    else:
        monkeypatch.setattr(target, _oom)
    code = main(["grpo", "--model", "tiny", "--output-dir", str(tmp_path / "run"), "--max-steps", "1", "--data.prompts_per_step", "2",
                 "--data.group_size", "2", "--data.eval_size", "4", "--sampling.max_new_tokens", "4", "--acceptance.sets", "[]", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    step = 0 if phase == "evaluation" else 1
    assert err[-1].startswith(f"posttrain: error: out of GPU memory at step {step}, during {phase}; reduce it with ") and knob in err[-1], err[-1]
    assert not any("Traceback" in line for line in err)
    assert (tmp_path / "run" / "config.yaml").is_file()


@pytest.mark.parametrize("recipe, target, phase, knob", [
    ("sft", "posttrain.recipes.sft.loss_step", "update", "micro_batch_size"),
    ("dpo", "posttrain.recipes.dpo.loss_step", "update", "memory.gradient_checkpointing"),
])
def test_out_of_memory_in_sft_and_dpo_updates(tmp_path, monkeypatch, recipe, target, phase, knob):
    """CPU MemoryError in the update of sft and dpo: the same one-line error."""
    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(target, no_memory)
    if recipe == "sft":
        config = build_config(sft.Config, None, {"model": "tiny", "output_dir": str(tmp_path / "run"), "max_steps": 1})
        run = sft.run
    else:
        pairs = tmp_path / "pairs.jsonl"
        pairs.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"{i}+{i}=", "chosen": f"<answer>{2 * i}</answer>",
                                             "rejected": "I do not know"}) + "\n" for i in range(10, 22)))
        config = build_config(dpo.Config, None, {"model": "tiny", "output_dir": str(tmp_path / "run"), "max_steps": 1,
                                                 "data": {"pairs": str(pairs), "heldout_pairs": 2}, "batch_size": 4, "micro_batch_size": 2})
        run = dpo.run
    with pytest.raises(UserError, match=rf"out of CPU memory at step 1, during {phase}; reduce it with .*{knob}") as raised:
        run(config)
    assert raised.value.exit_code == 3


def test_resume_without_a_checkpoint_starts_a_clean_log(tmp_path, caplog):
    """A run that died before its first checkpoint: the resume says so and metrics.jsonl holds one step-0 row."""
    config = _grpo(tmp_path, max_steps=1, checkpoint_every=5)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "heldout/pass@1": 0.5}\n{"step": 1, "reward/mean": 0.1}\n')
    from posttrain.config import save_yaml

    save_yaml(config, run_dir / "config.yaml")
    online.run(config, resume=True)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    assert any("no complete checkpoint" in r.message and "clean" in r.message for r in caplog.records)


def test_resume_with_a_changed_config_is_refused_or_recorded(tmp_path):
    """A changed loss or data field on resume: refused with the list of differences; accepted with
    resume_changed_config, and the run card lists them. max_steps may change freely."""
    first = _grpo(tmp_path, max_steps=1)
    online.run(first)
    changed = _grpo(tmp_path, max_steps=2, optim={"lr": 0.5}, data={"prompts_per_step": 4})
    with pytest.raises(UserError) as refused:
        online.run(changed, resume=True)
    message = str(refused.value)
    assert "2 field(s)" in message and "optim.lr:" in message and "data.prompts_per_step: 2 -> 4" in message
    assert "--resume-changed-config" in message and "max_steps" not in message
    online.run(changed, resume=True, resume_changed_config=True)
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    assert card["run"]["resumed_with_changes"] == message.split(": ", 1)[1].split(" (pass")[0].split("; ")
    online.run(_grpo(tmp_path, max_steps=3, optim={"lr": 0.5}, data={"prompts_per_step": 4}), resume=True)  # now the saved config


def test_config_changes_lists_only_unsafe_fields():
    saved = {"max_steps": 10, "optim": {"lr": 1e-4}, "update": {"micro_batch_size": 4, "epochs": 1}, "acceptance": {"eval_every": 5}}
    resumed = {"max_steps": 20, "optim": {"lr": 1e-4}, "update": {"micro_batch_size": 2, "epochs": 2}, "acceptance": {"eval_every": 1}}
    assert config_changes(saved, resumed) == ["update.epochs: 1 -> 2"]


def test_a_field_added_after_the_run_was_written_is_no_change_at_its_default():
    """A run written before `loss.off_policy` existed resumes without --resume-changed-config while
    the new field keeps its default (the behaviour the run had); set to anything else, it is a change."""
    saved = {"loss": {"advantage": "group"}}
    defaults = {"loss": {"advantage": "group", "off_policy": {"objective": "auto"}}}
    assert config_changes(saved, defaults, defaults) == []
    resumed = {"loss": {"advantage": "group", "off_policy": {"objective": "behaviour"}}}
    assert config_changes(saved, resumed, defaults) == ["loss.off_policy.objective: None -> 'behaviour'"]
    assert config_changes(saved, defaults) == ["loss.off_policy.objective: None -> 'auto'"]  # without defaults: as before


def test_cli_resume_with_changed_flags_needs_resume_changed_config(tmp_path, capsys):
    """`posttrain grpo --resume DIR --optim.lr X`: one line naming the dotted keys; with
    --resume-changed-config the run continues and its card lists the change, the section's other
    keys kept as the run had them (they once fell back to their defaults: the flag replaced the
    whole saved section)."""
    from posttrain.cli import main

    out = tmp_path / "run"
    assert main(["grpo", "--model", "tiny", "--output-dir", str(out), "--max-steps", "1", "--optim.warmup_steps", "3", "--data.prompts_per_step", "2",
                 "--data.group_size", "2", "--data.eval_size", "4", "--sampling.max_new_tokens", "4", "--acceptance.sets", "[]"]) == 0
    capsys.readouterr()
    assert main(["grpo", "--resume", str(out), "--max-steps", "2", "--optim.lr", "0.5"]) == 2
    assert "(got optim.lr; --resume-changed-config accepts" in capsys.readouterr().err
    assert main(["grpo", "--resume", str(out), "--max-steps", "2", "--optim.lr", "0.5", "--resume-changed-config"]) == 0
    card = json.loads((out / "run_card.json").read_text())
    assert card["run"]["resumed_with_changes"] == ["optim.lr: 1e-05 -> 0.5"]
    resumed = yaml.safe_load((out / "config.yaml").read_text())["optim"]
    assert resumed["warmup_steps"] == 3 and resumed["lr"] == 0.5
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
