"""rollout.engine vllm on vLLM's CPU build (`make test-vllm`, in .venv-vllm): weight sync proved by
greedy equality with the built-in engine after training steps (and a broken sync caught), the
Rollout contract, seeds and shards, the server mode, a GRPO run and tool episodes through vLLM.
Skipped where vLLM is not installed (the main environment)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from posttrain.config import build_config, parse_overrides  # noqa: E402
from posttrain.data.tokenize import render_prompt  # noqa: E402
from posttrain.errors import UserError  # noqa: E402
from posttrain.models import load_model  # noqa: E402
from posttrain.models.adapters import LoraSettings, apply_lora  # noqa: E402
from posttrain.models.forward import completion_logprobs  # noqa: E402
from posttrain.recipes import online, online_config  # noqa: E402
from posttrain.rollout.engine import generate  # noqa: E402
from posttrain.rollout.engines import RolloutSettings  # noqa: E402
from posttrain.rollout.sampling import SamplingConfig  # noqa: E402
from posttrain.rollout.vllm_backends import EngineUnavailable, RemoteBackend, VLLMSettings  # noqa: E402
from posttrain.rollout.vllm_engine import VLLMEngine  # noqa: E402
from tests.rewards_for_tests import digits  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent

SETTINGS = VLLMSettings(kv_cache_gb=0.25, max_model_len=1024, dtype="float32", gpu_memory_utilization=0.2)
DEVICE = os.environ.get("POSTTRAIN_TEST_DEVICE", "cpu")
"""Where the weight-sync and contract tests put the policy (bench/gpu_check.sh sets cuda on a GPU machine)."""


def tiny_model():
    model, tokenizer = load_model("tiny")
    return model.to(DEVICE), tokenizer
GREEDY = SamplingConfig(greedy=True, max_new_tokens=24)


def prompts(tokenizer, count=32):
    return [render_prompt(tokenizer, f"What is {a} + {b}?") for a, b in zip(range(count), range(7, 7 + 3 * count, 3))]


def train_steps(model, tokenizer, steps=3, lr=3e-3, seed=0):
    """A few real AdamW steps (next-token NLL on answers) so the weights move away from vLLM's copy."""
    generator = torch.Generator().manual_seed(seed)
    texts = [f"{a} + {b} = {a + b}" for a, b in torch.randint(0, 99, (16, 2), generator=generator).tolist()]
    ids = tokenizer(texts, return_tensors="pt", padding=True)["input_ids"].to(next(model.parameters()).device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tiny_model()


@pytest.fixture(scope="module")
def engine():
    return VLLMEngine(SETTINGS)


def test_greedy_equals_the_builtin_engine_after_training_steps(tiny, engine):
    """The proof of weight sync: after 3 AdamW steps (and again after 3 more), vLLM's greedy
    completions of 32 prompts equal the built-in engine's of the same weights, token for token."""
    model, tokenizer = tiny
    batch = prompts(tokenizer)
    engine(model, tokenizer, batch, sampling=GREEDY)  # loaded: the starting weights
    for round_ in range(2):
        train_steps(model, tokenizer, seed=round_)
        ours = generate(model, tokenizer, batch, sampling=GREEDY)
        theirs = engine(model, tokenizer, batch, sampling=GREEDY)
        assert engine.last_sync_s is not None and engine.last_sync_s > 0
        assert torch.equal(theirs.completion_ids, ours.completion_ids), f"round {round_}"
        assert theirs.texts == ours.texts
        assert torch.equal(theirs.finished, ours.finished)
        assert (theirs.logprobs - ours.logprobs).abs().max() < 1e-4
    syncs = engine.syncs
    engine(model, tokenizer, batch[:2], sampling=GREEDY)
    assert engine.syncs == syncs and engine.last_sync_s is None  # unchanged weights are not sent again


def test_a_broken_sync_is_caught(tiny, monkeypatch):
    """The equality test above fails when the sync does nothing: vLLM keeps the old weights."""
    model, tokenizer = tiny_model()
    engine = VLLMEngine(SETTINGS)
    batch = prompts(tokenizer)
    engine(model, tokenizer, batch, sampling=GREEDY)
    monkeypatch.setattr(engine.backend, "load_weights", lambda weights: None)  # a sync that sends nothing
    train_steps(model, tokenizer, steps=4, lr=1e-2)
    ours = generate(model, tokenizer, batch, sampling=GREEDY)
    assert not torch.equal(engine(model, tokenizer, batch, sampling=GREEDY).completion_ids, ours.completion_ids)


def test_lora_adapters_are_folded_before_sending(tiny):
    model, tokenizer = tiny_model()
    policy = apply_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"]))
    engine = VLLMEngine(SETTINGS)
    batch = prompts(tokenizer, 16)
    engine(policy, tokenizer, batch, sampling=GREEDY)
    train_steps(policy, tokenizer, steps=3, lr=2e-2)
    ours = generate(policy, tokenizer, batch, sampling=GREEDY)
    assert torch.equal(engine(policy, tokenizer, batch, sampling=GREEDY).completion_ids, ours.completion_ids)


def test_rollout_contract_sampled(tiny, engine):
    """G rows per prompt, group-contiguous; logprobs = sampler_logprobs (nothing truncates) and
    equal to the policy's own recomputation at the temperature; EOS in the loss mask; finished xor
    truncated; the same seed gives the same tokens, another seed others, a shard the same rows."""
    model, tokenizer = tiny
    batch = prompts(tokenizer, 4)
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=16)
    rollout = engine(model, tokenizer, batch, group_size=4, sampling=sampling, seed=3)
    assert rollout.completion_ids.shape[0] == 16 and rollout.group_size == 4
    assert rollout.prompt_index.tolist() == [b for b in range(4) for _ in range(4)]
    assert torch.equal(rollout.logprobs, rollout.sampler_logprobs)
    recomputed = completion_logprobs(model, rollout, rollout.forward_inputs(), sampling.temperature, 16)
    assert (recomputed - rollout.logprobs).abs().max() < 1e-4
    assert torch.equal(rollout.finished, ~rollout.truncated)
    eos = tokenizer.eos_token_id
    lengths = rollout.mask.sum(-1)
    for row in range(16):
        n = int(lengths[row])
        if rollout.finished[row]:
            assert rollout.completion_ids[row, n - 1] == eos
        else:
            assert n == sampling.max_new_tokens
    again = engine(model, tokenizer, batch, group_size=4, sampling=sampling, seed=3)
    assert torch.equal(again.completion_ids, rollout.completion_ids)
    other = engine(model, tokenizer, batch, group_size=4, sampling=sampling, seed=4)
    assert not torch.equal(other.completion_ids[:, :8], rollout.completion_ids[:, :8])
    half = engine(model, tokenizer, batch[2:], group_size=4, sampling=sampling, seed=3, shard=(2, 4))
    width = half.completion_ids.shape[1]
    assert torch.equal(half.completion_ids, rollout.completion_ids[8:, :width])


def test_stop_strings_end_a_row(tiny, engine):
    model, tokenizer = tiny
    free = engine(model, tokenizer, prompts(tokenizer, 8), sampling=GREEDY)
    # A stop string taken from the middle of each row's own greedy text: the row must end there.
    text = next(t for t in free.texts if len(t) >= 6)
    stop = text[2:4]
    stopped = engine(model, tokenizer, prompts(tokenizer, 8), sampling=SamplingConfig(greedy=True, max_new_tokens=24, stop_strings=(stop,)))
    for before, after, done in zip(free.texts, stopped.texts, stopped.finished.tolist()):
        if stop in before:
            assert done and after == before[: before.index(stop) + len(stop)]


def test_settings_vllm_cannot_honour_are_refused_before_any_work():
    for sampling, named in [(SamplingConfig(top_p=0.9), "sampling.top_p"), (SamplingConfig(top_k=5), "sampling.top_k"),
                            (SamplingConfig(min_new_tokens=2), "sampling.min_new_tokens"),
                            (SamplingConfig(greedy=True, temperature=0.5), "sampling.greedy")]:
        with pytest.raises(UserError, match=named):
            RolloutSettings(engine="vllm").validate(sampling)
    with pytest.raises(UserError, match="rollout.vllm.url is required"):
        RolloutSettings(engine="vllm", vllm=VLLMSettings(mode="server")).validate()


def test_a_model_vllm_cannot_load_is_one_line(tmp_path):
    model, tokenizer = load_model("tiny")
    model.config.architectures = ["NoSuchForCausalLM"]
    with pytest.raises(UserError, match="vLLM could not load the model"):
        VLLMEngine(SETTINGS)(model, tokenizer, ["hi"], sampling=GREEDY)
    model.config.architectures = ["LlamaForCausalLM"]


@pytest.fixture(scope="module")
def server():
    """`posttrain vllm-serve --model tiny --port 0`, a process of its own (as a user runs it)."""
    command = [sys.executable, "-m", "posttrain", "vllm-serve", "--model", "tiny", "--port", "0", "--kv-cache-gb", "0.25",
               "--max-model-len", "1024"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    match = None
    for line in process.stdout:  # vLLM logs to stdout too; the command's own line names the URL
        match = re.search(r"^vllm-serve: tiny at (http://\S+) ", line)
        if match:
            break
    assert match, "vllm-serve ended without printing its URL"
    threading.Thread(target=process.stdout.read, daemon=True).start()  # keep draining its log
    yield {"url": match.group(1), "process": process}
    process.terminate()
    process.wait(30)


def test_server_mode_syncs_and_matches_the_builtin_engine(server):
    """A run's policy (another seed than the server's start) pushed to the server, trained, pushed
    again: the server's greedy completions equal the built-in engine's each time."""
    torch.manual_seed(11)
    model, tokenizer = load_model("tiny")
    engine = VLLMEngine(VLLMSettings(mode="server", url=server["url"]))
    batch = prompts(tokenizer)
    for round_ in range(2):
        theirs = engine(model, tokenizer, batch, sampling=GREEDY)
        assert torch.equal(theirs.completion_ids, generate(model, tokenizer, batch, sampling=GREEDY).completion_ids), f"round {round_}"
        train_steps(model, tokenizer, seed=round_)
    assert engine.syncs == 2
    health = json.loads(urllib.request.urlopen(server["url"] + "/health").read())
    assert health["weight_pushes"] >= 2


def test_an_unreachable_server_is_one_line_naming_it():
    with pytest.raises(EngineUnavailable, match=r"vLLM server http://127.0.0.1:9 is unreachable .* after 2 attempt"):
        RemoteBackend("http://127.0.0.1:9", retries=2)


def small_config(tmp_path, *extra) -> online_config.Config:
    args = ["--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
            "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3",
            "--rollout.engine", "vllm", "--rollout.vllm.kv_cache_gb", "0.25", "--rollout.vllm.max_model_len", "1024", *extra]
    config = build_config(online_config.grpo_config, None, parse_overrides(args))
    config.output_dir = str(tmp_path / "run")
    return config


def test_grpo_run_on_vllm(tmp_path):
    """Three GRPO steps sampled by vLLM: each step's sync logged, the engine on the card, the held-out
    evaluation through the same engine, and the trainer's log-probs of vLLM's tokens within fp32 noise."""
    run_dir = online.run(small_config(tmp_path, "--max-steps", "3", "--acceptance.eval_every", "0"), reward=digits)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "rollout/sync_s" in row]
    assert len(steps) == 3 and all(row["rollout/sync_s"] > 0 for row in steps[1:])
    assert all(row["mismatch/logprob_abs_max"] < 1e-3 for row in steps), [row.get("mismatch/logprob_abs_max") for row in steps]
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["data"]["engine"]["name"] == "vllm"


def test_grpo_with_generation_overlapping_training_on_a_server(tmp_path, server):
    """data.async_generation against `posttrain vllm-serve`: a generation thread samples while the
    trainer trains, the server's weights pushed as they change; no batch older than k; the held-out
    evaluation (the trainer's own weights) and the generation thread share the engine in turns."""
    pushes = json.loads(urllib.request.urlopen(server["url"] + "/health").read())["weight_pushes"]
    config = small_config(tmp_path, "--max-steps", "4", "--acceptance.eval_every", "2", "--data.max_staleness", "1",
                          "--data.async_generation", "true", "--rollout.vllm.mode", "server", "--rollout.vllm.url", server["url"])
    run_dir = online.run(config, reward=digits)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["step"] > 0 and "offpolicy/staleness_max" in row]
    assert len(steps) == 4 and all(row["offpolicy/staleness_max"] <= 1 for row in steps)
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["data"]["engine"]["name"] == "vllm" and card["links"]["data"]["staleness"].startswith("asynchronous")
    assert json.loads(urllib.request.urlopen(server["url"] + "/health").read())["weight_pushes"] >= pushes + 3


def test_tool_episodes_on_vllm(tmp_path):
    """Tool episodes draw every turn through vLLM, ids in and out."""
    from posttrain.rollout.episodes import EpisodeSampler, ToolSettings
    from posttrain.rollout.tools import resolve_tools

    model, tokenizer = load_model("tiny")
    calls = []
    engine = VLLMEngine(SETTINGS)

    def counted(*args, **kwargs):
        calls.append(kwargs.get("draws"))
        return engine(*args, **kwargs)

    settings = ToolSettings(names=["add"], max_turns=2)
    sampler = EpisodeSampler(tokenizer, resolve_tools(settings.names), settings, counted)
    batch = [render_prompt(tokenizer, "What is 2 + 3?", tools=sampler.tools)] * 2
    rollout = sampler(model, tokenizer, [None, None], batch, group_size=2, sampling=SamplingConfig(max_new_tokens=12), seed=1)
    assert rollout.completion_ids.shape[0] == 4 and len(rollout.episodes) == 4 and calls


def test_a_server_that_died_is_engine_unavailable_naming_it(server):
    """The server gone mid-run (here: killed): the next sampling is one line naming the URL (the run
    then checkpoints and says how to resume: tests/test_engines.py)."""
    model, tokenizer = load_model("tiny")
    engine = VLLMEngine(VLLMSettings(mode="server", url=server["url"], connect_retries=1))
    engine(model, tokenizer, prompts(tokenizer, 2), sampling=GREEDY)
    server["process"].kill()
    server["process"].wait(30)
    with pytest.raises(EngineUnavailable, match=re.escape(server["url"]) + r" is unreachable"):
        engine(model, tokenizer, prompts(tokenizer, 2), sampling=GREEDY)


def run_cli(*args, cwd):
    result = subprocess.run([sys.executable, "-m", "posttrain", *args], capture_output=True, text=True, cwd=cwd,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_every_sampling_command_runs_on_vllm_from_the_cli(tmp_path):
    """grpo, eval and pairs with --rollout.engine vllm, as a user types them."""
    vllm_flags = ["--rollout.engine", "vllm", "--rollout.vllm.kv_cache_gb", "0.25"]
    run_cli("grpo", "--model", "tiny", "--data.eval_size", "4", "--data.prompts_per_step", "2", "--data.group_size", "2",
            "--sampling.max_new_tokens", "6", "--max-steps", "2", "--acceptance.sets", "[]", "--output-dir", str(tmp_path / "grpo"),
            *vllm_flags, cwd=tmp_path)
    card = json.loads((tmp_path / "grpo" / "run_card.json").read_text())
    assert card["links"]["data"]["engine"]["name"] == "vllm" and card["links"]["data"]["engine"]["version"]
    run_cli("eval", "--model", "tiny", "--task", "arithmetic", "--eval-size", "4", "--max-new-tokens", "6",
            "--output-dir", str(tmp_path / "eval"), *vllm_flags, cwd=tmp_path)
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["engine"]["name"] == "vllm"
    run_cli("pairs", "--model", "tiny", "--data.task", "arithmetic", "--data.max_prompts", "8", "--data.eval_size", "4",
            "--group-size", "4", "--max-new-tokens", "6", "--out", str(tmp_path / "pairs.jsonl"),
            "--verifier", "callable:rewards_for_tests.digits", *vllm_flags, cwd=tmp_path)
    assert (tmp_path / "pairs.jsonl").read_text().count("\n") > 0


@pytest.mark.parametrize("script, arguments, name", [
    ("vllm_rollout", ["--model", "tiny", "--rounds", "1", "--new-tokens", "4", "--prompts", "2", "--group-size", "2"], "vllm_sync"),
])
def test_vllm_bench_ends_with_its_result_lines(script, arguments, name):
    result = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), *arguments], capture_output=True, text=True,
                            cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    assert re.match(rf"^RESULT {name}: ours=[\d.]+ peer=[\d.]+ unit=\S+ ratio=[\d.]+$", last), last


def test_a_batch_longer_than_one_scheduler_step_samples(tiny, engine):
    """More prompt tokens than vLLM schedules in one step (4096 by default): on the CPU build a prompt
    split across steps crashed seeded sampling (its generator rewound); prompts prefill whole there."""
    model, tokenizer = tiny
    batch = [render_prompt(tokenizer, f"Add these numbers please: {a} and {a * 7} and {a * 13}.") for a in range(48)]
    assert sum(len(tokenizer(p)["input_ids"]) for p in batch) * 4 > 4096
    rollout = engine(model, tokenizer, batch, group_size=4, sampling=SamplingConfig(max_new_tokens=4), seed=1)
    assert rollout.completion_ids.shape[0] == 192


def test_two_torchrun_processes_sample_what_one_does(tmp_path):
    """GRPO on vLLM under torchrun: each rank's own vLLM engine (in a process of its own: the job's
    process group is not vLLM's) samples its shard with the prompts' global seeds, so 2 processes
    give the samples, rewards, losses and weights of 1."""
    from tests.test_distributed import GRPO, assert_same_run, run

    args = [*GRPO, "--acceptance.sets", "[]", "--max-steps", "3", "--rollout.engine", "vllm", "--rollout.vllm.kv_cache_gb", "0.25"]
    run([*args, "--output-dir", str(tmp_path / "one")], 1)
    run([*args, "--output-dir", str(tmp_path / "two")], 2)
    assert (tmp_path / "one" / "samples.jsonl").read_text() == (tmp_path / "two" / "samples.jsonl").read_text()
    assert_same_run(tmp_path / "one", tmp_path / "two", 3)
