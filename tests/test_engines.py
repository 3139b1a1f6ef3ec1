"""The engine table (`rollout/engines.py`) and the vLLM engine's own logic, without vLLM: the weights
it would send (Hugging Face names, LoRA folded), Rollouts from vLLM's records, when it syncs, the
settings it refuses, an unreachable server, and a run whose server dies (checkpoint, then resume).
The vLLM side itself is tests/test_vllm.py (`make test-vllm`)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.models import load_model
from posttrain.models.adapters import LoraSettings, apply_lora, merge_lora
from posttrain.recipes import online, online_config
from posttrain.rollout import engines
from posttrain.rollout.engine import generate
from posttrain.rollout.engines import Engine, RolloutSettings
from posttrain.rollout.sampling import SamplingConfig
from posttrain.rollout.vllm_backends import EngineUnavailable, RemoteBackend, VLLMSettings, hf_weights
from posttrain.rollout.vllm_engine import VLLMEngine, request_seed, to_rollout
from tests.rewards_for_tests import digits

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_hf_weights_are_the_checkpoint_names_and_values():
    model, _ = load_model("tiny")
    sent = dict(hf_weights(model))
    saved = {name: tensor for name, tensor in model.state_dict().items() if name != "lm_head.weight"}  # tied: once
    assert sent.keys() == saved.keys()
    assert all(torch.equal(sent[name], saved[name]) for name in saved)


def test_hf_weights_fold_lora_exactly_as_merging_does():
    torch.manual_seed(0)
    model, _ = load_model("tiny")
    policy = apply_lora(model, LoraSettings(rank=4, alpha=8.0, target_modules=["q_proj", "up_proj"]))
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)  # B = 0 at init: make the adapters do something
    sent = dict(hf_weights(policy))
    merged = {name: t for name, t in merge_lora(policy).state_dict().items() if name != "lm_head.weight"}
    assert sent.keys() == merged.keys()
    for name in merged:
        assert torch.allclose(sent[name], merged[name], atol=1e-6), name
    assert not torch.equal(sent["model.layers.0.self_attn.q_proj.weight"],
                           policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)


def test_records_become_a_rollout():
    _, tokenizer = load_model("tiny")
    eos = tokenizer.eos_token_id
    a, b = tokenizer("ab", add_special_tokens=False)["input_ids"], tokenizer("xyz", add_special_tokens=False)["input_ids"]
    results = [[{"token_ids": [a[0], eos], "logprobs": [-0.5, -0.25], "finish_reason": "stop"},
                {"token_ids": [a[1], a[0], a[1]], "logprobs": [-1.0, -2.0, -3.0], "finish_reason": "length"}],
               [{"token_ids": [eos], "logprobs": [-0.1], "finish_reason": "stop"},
                {"token_ids": [b[0], b[1], eos], "logprobs": [-1.0, -1.0, -1.0], "finish_reason": "length"}]]
    sampling = SamplingConfig(max_new_tokens=3)
    rollout = to_rollout([a, b + b], results, 2, sampling, tokenizer, [eos], torch.device("cpu"))
    assert rollout.completion_ids.shape == (4, 3) and rollout.prompt_ids.shape == (4, 6)
    assert rollout.mask.sum(-1).tolist() == [2, 3, 1, 3]
    # a full budget that ends on the stop token is finished, as in the built-in engine
    assert rollout.finished.tolist() == [True, False, True, True]
    assert torch.equal(rollout.truncated, ~rollout.finished)
    assert rollout.logprobs[1].tolist() == [-1.0, -2.0, -3.0] and rollout.logprobs[0, 2] == 0
    assert torch.equal(rollout.sampler_logprobs, rollout.logprobs)
    assert rollout.texts[1] == "bab" and rollout.prompt_attention_mask[0].sum() == 2
    greedy = to_rollout([a, b + b], results, 2, SamplingConfig(max_new_tokens=3, greedy=True), tokenizer, [eos], torch.device("cpu"))
    assert greedy.sampler_logprobs.abs().sum() == 0 and greedy.logprobs.abs().sum() > 0


class LocalCopy:
    """A backend that behaves as a vLLM server would, without vLLM: its own copy of the weights
    (loaded by `load_weights` under the checkpoint names), generation by the built-in engine."""

    def __init__(self, model, tokenizer, fail_after: int | None = None):
        self.model, self.tokenizer = load_model("tiny")[0], tokenizer
        self.model.load_state_dict(dict(hf_weights(model)), strict=False)
        self.loads, self.calls, self.fail_after = 0, 0, fail_after
        self.params = []

    def load_weights(self, weights):
        self.model.load_state_dict(dict(weights), strict=False)
        self.loads += 1

    def generate(self, id_lists, params):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise EngineUnavailable("vLLM server http://127.0.0.1:1 is unreachable (Connection refused) after 2 attempt(s)")
        self.params.extend(params)
        G = params[0]["n"]
        sampling = SamplingConfig(max_new_tokens=params[0]["max_tokens"], greedy=params[0]["temperature"] == 0,
                                  temperature=params[0]["temperature"] or 1.0)
        rollout = generate(self.model, self.tokenizer, id_lists, group_size=G, sampling=sampling, seed=params[0]["seed"])
        lengths = rollout.mask.sum(-1).tolist()
        records = [{"token_ids": rollout.completion_ids[r, :n].tolist(), "logprobs": rollout.logprobs[r, :n].tolist(),
                    "finish_reason": "stop" if rollout.finished[r] else "length"} for r, n in enumerate(lengths)]
        return [records[b * G:(b + 1) * G] for b in range(len(id_lists))]


def test_the_engine_syncs_only_when_the_weights_changed():
    model, tokenizer = load_model("tiny")
    backend = LocalCopy(model, tokenizer)
    engine = VLLMEngine(backend=backend)
    greedy = SamplingConfig(greedy=True, max_new_tokens=8)
    engine(model, tokenizer, ["1+1=", "2+2="], sampling=greedy)
    assert backend.loads == 1  # the first call sends the weights (it cannot know the server's)
    engine(model, tokenizer, ["1+1="], sampling=greedy)
    assert backend.loads == 1 and engine.last_sync_s is None
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.5)  # one in-place change, as an optimizer step makes
    result = engine(model, tokenizer, ["1+1=", "2+2="], sampling=greedy)
    assert backend.loads == 2 and engine.last_sync_s is not None
    assert torch.equal(result.completion_ids, generate(model, tokenizer, ["1+1=", "2+2="], sampling=greedy).completion_ids)


def test_each_prompt_has_its_own_seed_whoever_samples_it():
    model, tokenizer = load_model("tiny")
    backend = LocalCopy(model, tokenizer)
    engine = VLLMEngine(backend=backend)
    sampling = SamplingConfig(max_new_tokens=4)
    engine(model, tokenizer, ["a", "b", "c", "d"], group_size=2, sampling=sampling, seed=7)
    engine(model, tokenizer, ["c", "d"], group_size=2, sampling=sampling, seed=7, shard=(2, 4))
    seeds = [p["seed"] for p in backend.params]
    assert seeds[:4] == [request_seed(7, i) for i in range(4)] and seeds[4:] == seeds[2:4]
    assert len(set(seeds[:4])) == 4 and all(0 <= s < 2**62 for s in seeds)
    engine(model, tokenizer, ["x", "y"], sampling=sampling, seed=7, draws=([5, 1], 8))
    assert [p["seed"] for p in backend.params[-2:]] == [request_seed(7, 5), request_seed(7, 1)]


@pytest.mark.parametrize("overrides, message", [
    ({"engine": "sglang"}, "rollout.engine must be one of builtin, vllm, worker, got 'sglang'"),
    ({"vllm": VLLMSettings(mode="server", url="http://x:1")}, "the rollout.vllm section applies to rollout.engine vllm only"),
    ({"engine": "vllm", "vllm": VLLMSettings(mode="server")}, "rollout.vllm.url is required"),
    ({"engine": "vllm", "vllm": VLLMSettings(mode="remote")}, "rollout.vllm.mode must be one of colocate, server"),
    ({"engine": "vllm", "vllm": VLLMSettings(gpu_memory_utilization=1.5)}, "gpu_memory_utilization must be in"),
])
def test_bad_rollout_settings_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        RolloutSettings(**overrides).validate(SamplingConfig())


def test_sampling_vllm_cannot_report_is_refused_naming_the_setting():
    with pytest.raises(UserError, match="sampling.top_p 0.9 with rollout.engine vllm"):
        RolloutSettings(engine="vllm").validate(SamplingConfig(top_p=0.9))
    RolloutSettings(engine="builtin").validate(SamplingConfig(top_p=0.9))  # the built-in engine reports both


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_not_installed_names_the_extra():
    with pytest.raises(UserError, match=r"vLLM is not installed .*posttrain\[vllm\].*make vllm-env"):
        engines.make_engine(RolloutSettings(engine="vllm"))


def test_an_unreachable_server_is_one_line_after_bounded_retries():
    with pytest.raises(EngineUnavailable, match=r"^vLLM server http://127.0.0.1:9 is unreachable .* after 2 attempt\(s\)"):
        RemoteBackend("http://127.0.0.1:9", retries=2, timeout_s=2)


def small_config(tmp_path, *extra) -> online_config.Config:
    args = ["--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
            "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3", "--rollout.engine", "vllm",
            "--acceptance.eval_every", "0", "--acceptance.sets", "[]", "--checkpoint-every", "10", *extra]
    config = build_config(online_config.grpo_config, None, parse_overrides(args))
    config.output_dir = str(tmp_path / "run")
    return config


def fake_vllm(monkeypatch, fail_after: int | None):
    """`rollout.engine vllm` served by a `LocalCopy` (its server dies after `fail_after` generations)."""
    made = []

    class Lazy(VLLMEngine):
        def _start(self, model, tokenizer):
            self.backend = LocalCopy(model, tokenizer, fail_after)
            made.append(self.backend)

    entry = dataclasses.replace(engines.ENGINES["vllm"], make=lambda settings: Lazy(settings.vllm))
    monkeypatch.setitem(engines.ENGINES, "vllm", entry)
    return made


def test_a_server_dying_mid_run_checkpoints_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    """Generations: the step-0 evaluation, then one per step; the server dies at step 3's sampling:
    the run stops with one line, step-2 is checkpointed (checkpoint_every is 10), --resume finishes."""
    fake_vllm(monkeypatch, fail_after=3)
    config = small_config(tmp_path, "--max-steps", "4")
    with pytest.raises(UserError, match=r"unreachable .*while sampling step 3; checkpoint step-2 written\); to resume \(a server once it is back\): "
                                        r"posttrain grpo --resume .*run"):
        online.run(config, reward=digits)
    assert (tmp_path / "run" / "checkpoints" / "step-000002").is_dir()
    made = fake_vllm(monkeypatch, fail_after=None)
    run_dir = online.run(config, resume=True, reward=digits)
    assert (run_dir / "checkpoints" / "step-000004").is_dir() and made[0].loads >= 2
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "rollout/sync_s" in row] == [1, 2, 3, 4]
    assert json.loads((run_dir / "run_card.json").read_text())["links"]["data"]["engine"]["name"] == "vllm"


def test_the_engine_table_entries_are_complete():
    for name, entry in engines.ENGINES.items():
        assert isinstance(entry, Engine) and entry.name == name and entry.summary
        assert entry.describe(RolloutSettings(engine=name))["name"] == name
