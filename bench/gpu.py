"""Ours vs TRL / transformers on one GPU, side by side in one run: a GRPO step, a DPO step, generation.

Runs only where a GPU is lent (this project's development machines have none): `bash bench/gpu_check.sh`
(`make gpu-check`) installs the wheels `bash bench/gpu_wheels.sh` fetched into .whl/, runs the CUDA
tests, then this script:

    python3 bench/gpu.py                                  # the GPU run (planned for under 4 minutes on an H200)
    .venv/bin/python bench/gpu.py --device cpu --small   # tiny shapes on the CPU (~30 s here): the script's own test

Both need the sides' packages (torch, transformers, trl, datasets; posttrain from this checkout).

Model: a Qwen2.5-0.5B-shaped Llama built in code from a `LlamaConfig` with RANDOM weights (weights
do not change the speed of a step): hidden 896, 24 layers, 14 heads, 2 KV heads (head_dim 64),
intermediate 4864, vocab 151936, tied embeddings, rope_theta 1e6, RMSNorm eps 1e-6 (a Llama, so no
q/k/v biases, unlike Qwen2). Tokenizer: a word-level `tokenizers` vocabulary of exactly 151936
entries (`<pad>` 0, `<eos>` 1, `t2` ... `t151935`) in a `PreTrainedTokenizerFast`, no chat template
(posttrain then uses a prompt as written, and so does TRL for a plain-string prompt), so every
sampled id decodes and the LM head is the real size. Prompts and responses are random words; every
prompt has exactly the same number of tokens, so no side pads. Both are saved with
`save_pretrained` (float32) into a temporary directory that both sides load from.

1. GRPO, one step = 8 prompts (128 tokens each) x G=8 completions of exactly 256 new tokens,
   temperature 1 (no top-k / top-p), beta 0.04 (k3 KL in the loss, a frozen reference), one
   optimizer step per batch (mu = 1), token-mean loss (TRL: loss_type "dapo"), AdamW lr 1e-6,
   gradient clipping at 1.0, no gradient checkpointing, bf16-mixed (float32 weights and optimizer
   state, bfloat16 autocast: ours `hardware.precision bf16-mixed`, TRL `bf16=True`). A random model's
   EOS timing is arbitrary, so both sides set min_new_tokens = max_new_tokens (ours:
   `sampling.min_new_tokens`; TRL: `generation_kwargs={"min_new_tokens": 256}`, which its
   `GenerationConfig` takes, so transformers' MinNewTokens processor bans EOS): every row has exactly
   256 tokens on both sides (checked). The reward (the fraction of even token ids in the completion)
   is a plain Python function, the same on both sides. Ours: `posttrain.recipes.online.setup(config,
   reward)` from `build_config(online_config.grpo_config, overrides)` with `hardware: {device: cuda,
   precision: bf16-mixed}`, then `online.sample(state)` + the library's step timed (bench/grpo.py's
   `library_step`: the loss link's `losses.policy_gradient.prepare` + `step` on the recipe's models
   and settings, without run-directory logging, evaluation and checkpoints; the recipe's other
   defaults stay, e.g. its exact-KL metric on 64 tokens, loss.sampler_correction none);
   TRL: `GRPOTrainer.train()` (its own transformers generation, no vLLM) timed between
   `on_step_end` callbacks. Both sides see the same prompts in the same order.
2. DPO, one step = 16 pairs, prompt 256 + chosen / rejected 256 tokens each (+ EOS), sigmoid loss,
   beta 0.1, AdamW lr 1e-6, clipping at 1.0, a live frozen reference, bf16-mixed, no gradient
   checkpointing on either side (TRL's DPOConfig turns it on by default; off here so both do the
   same computation). Ours: the loss link's `losses.preference.step` (forward, backward, clip and
   optimizer step) through the recipe's `TrainingForward` on its placement (as bench/dpo.py); TRL:
   `DPOTrainer.train()`, timed between `on_step_end` callbacks.
3. Generation (run first: it says most about our engine), 8 prompts x G=8 = 64 rows, temperature 1,
   on the same model with bfloat16 weights for both engines: `posttrain.rollout.generate` vs
   transformers' `model.generate(num_return_sequences=8)`, in one process, after one short warm-up
   call each, rounds interleaved (ours, peer, peer, ours, ...), on two lines: `gpu_generate`, every
   row exactly 256 new tokens (min_new_tokens = max on both), and `gpu_generate_stops`, every row
   ending at its first stop token (every 256th id is one, about 0.4% of a random model's draws, on
   both sides), so rows finish at spread-out lengths and our engine's row compaction is timed; each
   engine there has its own draws and is counted by its real tokens (its mean length is printed).
   Our weight copy is released before each peer call, so the peer's peak memory is its own.

Each training side runs in its own process: its peak GPU memory is its own
(`torch.cuda.max_memory_allocated` over the whole process: weights, reference, optimizer state,
activations, generation), a crash or a hang (out of memory, a CUDA error) costs only that side, and
each side gets a timeout within `--budget` seconds, so the script always ends with its table. The
generation line shares one model between the engines, with `torch.cuda.reset_peak_memory_stats`
before each engine's calls. Times are medians of the timed steps / rounds after `--warmup` warm-up
steps, with `torch.cuda.synchronize()` before each clock read. Before each side's first step (ours:
before its loop; TRL: at `on_train_begin`; generation: before the warm-up calls) the garbage collector
runs and freezes what survives (`settle_garbage`), so a full collection of the setup's objects (torch,
transformers, the model) never lands in a timed step. tokens/s: completion tokens (GRPO,
generation) or real pair tokens (DPO) per second of the whole step. On the CPU, "peak" is the
process's peak RSS instead.

The ratio column is > 1 when ours is better (peer / ours for s/step, ours / peer for tokens/s).
The first line printed names the code (the commit from git, or from .whl/STAMP where the copy has no
.git: bench/tree_hash.py). The script ends with its RESULT lines, each naming that commit
(`+local` when the files differ from it):

    RESULT gpu_generate: ours=X peer=Y unit=tokens/s ratio=R commit=abc1234
    RESULT gpu_generate_stops: ours=X peer=Y unit=tokens/s ratio=R commit=abc1234
    RESULT gpu_grpo: ours=X peer=Y unit=s/step ratio=R commit=abc1234
    RESULT gpu_dpo: ours=X peer=Y unit=s/step ratio=R commit=abc1234

(a side that failed prints nan). Without a CUDA device and without `--device cpu` it prints that it
skipped and exits 0 (so `make bench` passes on the development machines).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/gpu.py` from a checkout where posttrain is not installed
    sys.path.insert(0, str(ROOT))

import tree_hash  # noqa: E402 (bench/tree_hash.py, beside this file: which posttrain ran)
from grpo import library_step  # noqa: E402 (bench/grpo.py: the library's GRPO step, timed as there)

SEED = 0
PAD, EOS = 0, 1
MODELS = {
    "full": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "small": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1000),
}
SHAPES = {  # prompts x G, new tokens, prompt tokens; DPO pairs, prompt tokens, response tokens
    "full": dict(prompts=8, group=8, new_tokens=256, prompt_tokens=128, pairs=16, pair_prompt=256, pair_response=256,
                 stop_every=256),
    "small": dict(prompts=2, group=2, new_tokens=8, prompt_tokens=8, pairs=2, pair_prompt=16, pair_response=16,
                  stop_every=8),
}
GRPO_BETA, DPO_BETA, LR, TEMPERATURE = 0.04, 0.1, 1e-6, 1.0
SIDE_SECONDS = {"full": {"grpo": 110, "dpo": 60, "generate": 120}, "small": {"grpo": 240, "dpo": 240, "generate": 240}}
"""Most seconds a side's process may take (within what is left of --budget)."""


# ---------------------------------------------------------------- the model, tokenizer and data

def build_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly `vocab_size` entries: <pad> 0, <eos> 1, t2 ... t{V-1};
    words split on whitespace, decoded joined by spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"t{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    assert len(tokenizer) == vocab_size
    return tokenizer


def build_model(size: str):
    """The random-weight Llama of `size` (see the module docstring), float32 on the CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[size], tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768, hidden_act="silu", attention_bias=False, mlp_bias=False,
                         pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = PAD, EOS
    model.generation_config.bos_token_id = None
    return model


def words(rng: random.Random, count: int, vocab_size: int) -> str:
    return " ".join(f"t{rng.randrange(2, vocab_size)}" for _ in range(count))


def prepare(workdir: Path, size: str, rows: int) -> dict:
    """Save the model and tokenizer, the GRPO prompt file and the DPO pairs under `workdir`."""
    shape, vocab = SHAPES[size], MODELS[size]["vocab_size"]
    started = time.perf_counter()
    model, tokenizer = build_model(size), build_tokenizer(vocab)
    model.save_pretrained(workdir / "model")
    tokenizer.save_pretrained(workdir / "model")
    rng = random.Random(SEED)
    with open(workdir / "prompts.jsonl", "w") as handle:  # the held-out row + every step's prompts
        for index in range(rows + 1):
            handle.write(json.dumps({"id": f"p{index}", "prompt": words(rng, shape["prompt_tokens"], vocab), "answer": "0"}) + "\n")
    pairs = [{"id": f"r{index}", "prompt": words(rng, shape["pair_prompt"], vocab),
              # a leading space: the same tokens whether a side tokenises prompt + response apart or joined
              "chosen": " " + words(rng, shape["pair_response"], vocab),
              "rejected": " " + words(rng, shape["pair_response"], vocab)} for index in range(shape["pairs"] * 16)]
    (workdir / "pairs.json").write_text(json.dumps(pairs))
    return {"parameters": sum(p.numel() for p in model.parameters()), "seconds": time.perf_counter() - started}


def reward_of(completion: str) -> float:
    """The fraction of the completion's words that are even token ids (any word that is not one counts as odd)."""
    found = completion.split()
    return sum(w[1:].isdigit() and int(w[1:]) % 2 == 0 for w in found) / max(1, len(found))


# ---------------------------------------------------------------- one side, in its own process

class Device:
    """Clock and peak memory of one side: CUDA (synchronised, max_memory_allocated) or the CPU (peak RSS)."""

    def __init__(self, name: str):
        import torch

        self.torch, self.cuda = torch, name.startswith("cuda")
        self.name = name

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def settle_garbage() -> None:
    """Collect now and move every surviving object to the permanent generation (`gc.freeze`). A
    full (generation 2) collection scans the whole heap, and when one runs depends on the count of
    objects allocated since setup began: without this it fell in whichever timed step crossed the
    threshold (any import or object before the loop moved it), and with two timed steps that step
    is half the median. After it, a collection scans only what the steps themselves keep."""
    gc.collect()
    gc.freeze()


def hardware_settings(arguments) -> dict:
    return {"hardware": {"device": arguments.device, "precision": arguments.precision}}


def training_steps(arguments) -> int:
    return arguments.warmup + arguments.steps


def grpo_ours(arguments, workdir: Path, device: Device) -> dict:
    from posttrain.config import build_config
    from posttrain.recipes import online, online_config
    from posttrain.runs.timer import Timer

    shape, total = SHAPES[arguments.size], training_steps(arguments)
    B, G, T = shape["prompts"], shape["group"], shape["new_tokens"]
    config = build_config(online_config.grpo_config, None, {
        "model": str(workdir / "model"), "max_steps": total, "seed": SEED, **hardware_settings(arguments),
        "data": {"task": str(workdir / "prompts.jsonl"), "task_options": {"answer_format": "text"},
                 "train_size": B * total, "eval_size": 1, "prompts_per_step": B, "group_size": G},
        "sampling": {"temperature": TEMPERATURE, "max_new_tokens": T, "min_new_tokens": T},
        "loss": {"kl": {"beta": GRPO_BETA}}, "optim": {"lr": LR},
        "update": {"epochs": 1, "mini_batches": 1, "micro_batch_size": B * G},
    })
    state = online.setup(config, reward=lambda completion, example: reward_of(completion))
    state.policy.train()
    settle_garbage()
    durations, tokens, generation, prompts = [], [], [], []
    for _ in range(total):
        timer = Timer()
        started = device.now()
        batch = online.sample(state, timer)
        library_step(state, batch, timer)
        durations.append(device.now() - started)
        tokens.append(int(batch.rollout.mask.sum()))
        generation.append(timer.seconds.get("generation", 0.0))
        prompts.append([e.id for e in batch.examples])
    return summary(arguments, durations, tokens, device, generation=generation, prompts=prompts,
                   placement=state.placement.describe())


def grpo_examples(arguments, workdir: Path) -> list:
    """The training prompts in the order the recipe's PromptStream hands them out."""
    from posttrain.data.stream import PromptStream
    from posttrain.data.tasks import load_splits

    shape, total = SHAPES[arguments.size], training_steps(arguments)
    train, _ = load_splits(str(workdir / "prompts.jsonl"), train_size=shape["prompts"] * total, eval_size=1, seed=SEED,
                           options={"answer_format": "text"})
    return PromptStream(train, SEED).take(shape["prompts"] * total)


def precision_flags(arguments) -> dict:
    """TRL's (HF Trainer's) flags for our precision: bf16-mixed = bf16=True (autocast, float32 weights)."""
    if arguments.precision not in ("bf16-mixed", "fp32"):
        raise SystemExit(f"TRL has no counterpart here for precision {arguments.precision}")
    return {"bf16": arguments.precision == "bf16-mixed", "use_cpu": arguments.device == "cpu"}


def clock_callback(device: Device, marks: list[float]):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            settle_garbage()
            marks.append(device.now())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(device.now())

    return Clock()


def grpo_trl(arguments, workdir: Path, device: Device) -> dict:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape, total = SHAPES[arguments.size], training_steps(arguments)
    B, G, T = shape["prompts"], shape["group"], shape["new_tokens"]
    torch.manual_seed(SEED)
    # name_or_path is the directory: TRL loads its reference model from there (float32, like the policy).
    policy = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    examples = grpo_examples(arguments, workdir)
    dataset = datasets.Dataset.from_list([{"prompt": e.prompt, "id": e.id} for e in examples])
    marks: list[float] = []
    tokens: list[int] = []
    prompts: list[list[str]] = []

    def reward(prompts, completions, **kwargs):
        return [reward_of(c) for c in completions]

    args = trl.GRPOConfig(
        output_dir=str(workdir / "trl-grpo"), per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
        num_generations=G, max_completion_length=T, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": T}, beta=GRPO_BETA, num_iterations=1, loss_type="dapo",
        scale_rewards="group", epsilon=0.2, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, weight_decay=0.0, use_vllm=False, gradient_checkpointing=False, shuffle_dataset=False,
        max_steps=total, report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=SEED, log_completions=False, **precision_flags(arguments),
    )
    trainer = trl.GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[clock_callback(device, marks)])
    generate_and_score = trainer._generate_and_score_completions

    def counted(inputs, *a, **k):
        prompts.append([row["id"] for row in inputs[::G]])
        output = generate_and_score(inputs, *a, **k)
        tokens.append(int(output["completion_mask"].sum()))
        return output

    trainer._generate_and_score_completions = counted
    trainer.train()
    durations = [end - start for start, end in zip(marks, marks[1:])]
    return summary(arguments, durations, tokens, device, prompts=prompts, trl=trl.__version__)


def dpo_pairs(arguments, workdir: Path) -> list[dict]:
    shape = SHAPES[arguments.size]
    return json.loads((workdir / "pairs.json").read_text())[: shape["pairs"] * training_steps(arguments)]


def dpo_ours(arguments, workdir: Path, device: Device) -> dict:
    from posttrain.config import build_config
    from posttrain.data import PreferencePair, tokenize_preference_pairs
    from posttrain.hardware import resolve
    from posttrain.losses.preference import PreferenceModels, PreferenceSettings
    from posttrain.losses.preference import step as loss_step
    from posttrain.models import make_reference
    from posttrain.models.forward import TrainingForward
    from posttrain.models.loading import load_policy
    from posttrain.models.pair_forward import pair_logprobs
    from posttrain.optim import Trainable, make_optimizer
    from posttrain.recipes import dpo_config

    shape, total = SHAPES[arguments.size], training_steps(arguments)
    P = shape["pairs"]
    config = build_config(dpo_config.Config, None, {
        "model": str(workdir / "model"), "data": {"pairs": "bench", "use_chat_template": False},
        "batch_size": P, "micro_batch_size": P, "optim": {"lr": LR}, "loss": {"beta": DPO_BETA, "reference": "live"},
        **hardware_settings(arguments),
    })
    placement = resolve(config.hardware)
    policy, tokenizer = load_policy(config.model, placement=placement)
    trainer = TrainingForward(policy, pair_logprobs, placement=placement)  # what the recipe trains through
    optimizer, scheduler = make_optimizer(trainer.parameters(), config.optim, total)
    models = PreferenceModels(Trainable(trainer, optimizer, scheduler, config.optim.max_grad_norm), make_reference(policy))
    rows = [PreferencePair(r["id"], r["prompt"], r["chosen"], r["rejected"]) for r in dpo_pairs(arguments, workdir)]
    policy.train()
    settle_garbage()
    durations, tokens = [], []
    for step in range(total):
        started = device.now()
        batch = tokenize_preference_pairs(tokenizer, rows[step * P:(step + 1) * P], truncation=config.data.truncation(),
                                          use_chat_template=config.data.use_chat_template)
        tokens.append(int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum()))
        loss_step(models, batch.to(placement.device), PreferenceSettings(config.loss, config.micro_batch_size))
        durations.append(device.now() - started)
    return summary(arguments, durations, tokens, device, placement=placement.describe())


def dpo_trl(arguments, workdir: Path, device: Device) -> dict:
    import copy

    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape, total = SHAPES[arguments.size], training_steps(arguments)
    policy = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    marks: list[float] = []
    args = trl.DPOConfig(
        output_dir=str(workdir / "trl-dpo"), beta=DPO_BETA, loss_type=["sigmoid"], learning_rate=LR, max_steps=total,
        per_device_train_batch_size=shape["pairs"], gradient_accumulation_steps=1, max_length=None,
        gradient_checkpointing=False, precompute_ref_log_probs=False, report_to=[], logging_strategy="no",
        save_strategy="no", disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        dataloader_num_workers=0, seed=SEED, dataset_num_proc=None, **precision_flags(arguments),
    )
    rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in dpo_pairs(arguments, workdir)]
    trainer = trl.DPOTrainer(model=policy, ref_model=copy.deepcopy(policy), args=args, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[clock_callback(device, marks)])
    pair_tokens = []
    for row in trainer.train_dataset.select(range(shape["pairs"] * total)):  # what TRL tokenised: prompt + both responses
        prompt = len(row["prompt_ids"]) if "prompt_ids" in row else 0
        pair_tokens.append(2 * prompt + len(row.get("chosen_ids", [])) + len(row.get("rejected_ids", [])))
    trainer.train()
    durations = [end - start for start, end in zip(marks, marks[1:])]
    per_step = [sum(pair_tokens[s * shape["pairs"]:(s + 1) * shape["pairs"]]) for s in range(total)]
    return summary(arguments, durations, per_step, device, trl=trl.__version__)


def stop_ids(size: str) -> list[int]:
    """The early-stop line's stop tokens: every `stop_every`-th id (t256, t512, ... in the full shape:
    ~0.4% of a near-uniform random model's draws), so rows end at spread-out lengths and finished rows
    leave the batch."""
    every = SHAPES[size]["stop_every"]
    return list(range(every, MODELS[size]["vocab_size"], every))


def generate_both(arguments, workdir: Path, device: Device) -> dict:
    """Both engines on one bf16 model in this process, on two lines: every row exactly T new tokens
    (`full`), and rows that end at the first stop token (`stops`, each engine its own draws, counted
    by their real tokens). Rounds interleaved; our weight copy is released before each peer round
    (on the CPU generate keeps it), so the peer's peak memory is its own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.rollout import SamplingConfig, decoder_weights, generate

    shape = SHAPES[arguments.size]
    B, G, T = shape["prompts"], shape["group"], shape["new_tokens"]
    dtype = torch.bfloat16 if arguments.generate_dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", dtype=dtype).to(arguments.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(workdir / "model")
    prompts = [json.loads(line)["prompt"] for line in (workdir / "prompts.jsonl").read_text().splitlines()[:B]]
    stops = stop_ids(arguments.size)

    def ours(new_tokens: int, early: bool) -> int:
        sampling = SamplingConfig(temperature=TEMPERATURE, max_new_tokens=new_tokens, min_new_tokens=0 if early else new_tokens,
                                  stop_token_ids=tuple(stops) if early else ())
        rollout = generate(model, tokenizer, prompts, group_size=G, sampling=sampling, seed=SEED)
        return int(rollout.mask.sum())

    def peer(new_tokens: int, early: bool) -> int:
        decoder_weights.release(model)
        tokenizer.padding_side = "left"
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(arguments.device)
        with torch.inference_mode():
            out = model.generate(**batch, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=0 if early else new_tokens, num_return_sequences=G, pad_token_id=PAD,
                                 eos_token_id=[EOS, *stops] if early else EOS)
        generated = out[:, batch["input_ids"].shape[1]:]
        if not early:
            return int(generated.numel())
        ended = torch.isin(generated, torch.tensor([EOS, *stops], device=generated.device))
        first = torch.where(ended.any(1), ended.int().argmax(1) + 1, generated.shape[1])  # tokens up to the stop, inclusive
        return int(first.sum())

    engines = {"ours": ours, "peer": peer}
    lines = {"full": False, "stops": True}
    results = {line: {name: {"seconds": [], "peak": 0.0, "tokens": []} for name in engines} for line in lines}
    settle_garbage()
    for name, run in engines.items():  # warm-up: kernels, allocator, weight copies
        started = device.now()
        run(min(8, T), False)
        results["full"][name]["warmup_seconds"] = device.now() - started
    for round_ in range(arguments.rounds):
        for line, early in lines.items():
            for name in (("ours", "peer") if round_ % 2 == 0 else ("peer", "ours")):
                device.reset_peak()
                started = device.now()
                produced = engines[name](T, early)
                results[line][name]["seconds"].append(device.now() - started)
                results[line][name]["tokens"].append(produced)
                results[line][name]["peak"] = max(results[line][name]["peak"], device.peak_gib())
    for line, by_engine in results.items():
        for name, result in by_engine.items():
            if line == "full":
                assert all(t == B * G * T for t in result["tokens"]), (name, result["tokens"], B * G * T)
            median = statistics.median(result["seconds"])
            result.update(median_seconds=median, tokens_per_second=statistics.median(
                t / s for t, s in zip(result["tokens"], result["seconds"])), mean_length=statistics.mean(result["tokens"]) / (B * G))
    return {"ours": results["full"]["ours"], "peer": results["full"]["peer"], "stops": results["stops"], "dtype": str(dtype)}


def summary(arguments, durations, tokens, device: Device, **extra) -> dict:
    timed = list(range(arguments.warmup, len(durations)))
    if not timed:
        raise SystemExit(f"only {len(durations)} steps were timed")
    median = statistics.median(durations[i] for i in timed)
    return {"seconds": median, "all_seconds": durations, "tokens": tokens,
            "tokens_per_second": statistics.median(tokens[i] for i in timed) / median, "peak": device.peak_gib(), **extra}


SIDES = {"grpo-ours": grpo_ours, "grpo-trl": grpo_trl, "dpo-ours": dpo_ours, "dpo-trl": dpo_trl, "generate": generate_both}


def run_side(arguments) -> None:
    import torch

    if arguments.device == "cpu":
        torch.set_num_threads(1)  # as bench/grpo.py: stable on a shared 2-core machine
    device = Device(arguments.device)
    result = SIDES[arguments.side](arguments, Path(arguments.workdir), device)
    print("@@result " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the parent: sides, table, RESULT lines

def side(name: str, arguments, workdir: Path, deadline: float) -> dict:
    """Run one side in a fresh process within its time; its result, or {"error": ...}."""
    line = name.split("-")[0]
    timeout = min(SIDE_SECONDS[arguments.size][line], deadline - time.monotonic())
    if timeout < 5:
        return {"error": "no time left in --budget"}
    command = [sys.executable, __file__, "--side", name, "--workdir", str(workdir), "--device", arguments.device,
               "--precision", arguments.precision, "--steps", str(arguments.steps), "--warmup", str(arguments.warmup),
               "--rounds", str(arguments.rounds), "--generate-dtype", arguments.generate_dtype]
    if arguments.small:
        command.append("--small")
    started = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as log:
        try:
            finished = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            log.seek(0)
            tail = log.read()[-1500:]
            return {"error": f"timed out after {timeout:.0f} s", "log": tail}
        log.seek(0)
        tail = log.read()[-3000:]
    wall = time.monotonic() - started
    lines = [l for l in finished.stdout.splitlines() if l.startswith("@@result ")]
    if finished.returncode != 0 or not lines:
        return {"error": f"exit {finished.returncode}", "log": tail}
    return {**json.loads(lines[-1][len("@@result "):]), "wall": wall}


def machine_line(arguments, described: str) -> str:
    import torch
    import transformers

    try:
        import trl

        trl_version = trl.__version__
    except ImportError:
        trl_version = "absent"
    gpu = (f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})" if arguments.device.startswith("cuda")
           else f"CPU {platform.machine()} {os.cpu_count()} cores")
    return (f"date {datetime.datetime.now():%Y-%m-%d %H:%M}, {gpu}, python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, trl {trl_version}, {described}")


def fmt(value, digits: int = 3) -> str:
    return "nan" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --small: the script's own test)")
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "fp32"],
                        help="training precision of both sides (ours: hardware.precision; TRL: bf16=True / False)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (2 layers, hidden 64, vocab 1000, 2 prompts x G=2, 8 new tokens, 2 pairs of 32 tokens)")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed training steps first")
    parser.add_argument("--rounds", type=int, default=2, help="timed generation rounds per engine (median reported)")
    parser.add_argument("--generate-dtype", default="bf16", choices=["bf16", "fp32"], help="the generation line's weights, both engines")
    parser.add_argument("--budget", type=float, default=230, help="seconds for all sides together; a side past it is cut")
    parser.add_argument("--only", default="generate,grpo,dpo",
                        help="comma-separated lines to run, in this order (generation first: it says most about our engine)")
    parser.add_argument("--side", choices=list(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    arguments.size = "small" if arguments.small else "full"
    if arguments.steps < 1 or arguments.warmup < 0 or arguments.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    if arguments.side:
        run_side(arguments)
        return
    import torch

    if arguments.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here; it runs where a GPU is lent (bash bench/gpu_check.sh), "
              "or on the CPU as a test: --device cpu --small. Skipped.")
        return
    # A timeout's SIGTERM (bench/gpu_check.sh) becomes SystemExit, so subprocess.run kills the running side.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lines = [name.strip() for name in arguments.only.split(",") if name.strip()]
    shape, model = SHAPES[arguments.size], MODELS[arguments.size]
    deadline = time.monotonic() + arguments.budget
    commit, described = tree_hash.identity(ROOT / ".whl" / "STAMP")
    print(machine_line(arguments, described), flush=True)
    print(f"model: random Llama {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, {model['num_attention_heads']} heads / "
          f"{model['num_key_value_heads']} KV, intermediate {model['intermediate_size']}, vocab {model['vocab_size']}, tied; "
          f"training {arguments.precision}, {arguments.warmup} warm-up + {arguments.steps} timed steps (median)", flush=True)
    with tempfile.TemporaryDirectory(prefix="posttrain-gpu-bench-") as directory:
        workdir = Path(directory)
        made = prepare(workdir, arguments.size, shape["prompts"] * training_steps(arguments))
        print(f"built and saved the model ({made['parameters'] / 1e6:.1f}M parameters) in {made['seconds']:.1f} s", flush=True)
        results = {}
        names = [n for line in lines for n in ((f"{line}-ours", f"{line}-trl") if line != "generate" else ("generate",))]
        for name in names:
            results[name] = side(name, arguments, workdir, deadline)
            shown = {k: v for k, v in results[name].items() if k not in ("log", "prompts")}
            print(f"side {name}: {json.dumps(shown)}", flush=True)  # kept if a later side dies
            if "error" in results[name]:
                print(f"--- {name} failed ({results[name]['error']}); the end of its log:\n{results[name].get('log', '')}\n---", flush=True)
    memory = "peak GiB" if arguments.device.startswith("cuda") else "peak RSS GiB"
    rows = []  # (name, ours, peer, unit, ratio, ours tokens/s, peer tokens/s, ours peak, peer peak, note)

    def value(result, key):
        return None if result is None or "error" in result else result[key]

    if "generate" in lines:
        both = results["generate"]
        ours, peer = (None, None) if "error" in both else (both["ours"], both["peer"])
        note = (f"{shape['prompts']} x G={shape['group']} rows x {shape['new_tokens']} new tokens, {arguments.generate_dtype} weights, "
                f"median of {arguments.rounds} rounds")
        rows.append(("gpu_generate", value(ours, "tokens_per_second"), value(peer, "tokens_per_second"), "tokens/s", "higher",
                     value(ours, "tokens_per_second"), value(peer, "tokens_per_second"), value(ours, "peak"), value(peer, "peak"), note))
        ours, peer = (None, None) if "error" in both else (both["stops"]["ours"], both["stops"]["peer"])
        note = (f"the same rows, each ending at its first stop token (1 id in {shape['stop_every']}), up to {shape['new_tokens']} new tokens: mean length "
                f"ours {fmt(value(ours, 'mean_length'), 0)}, peer {fmt(value(peer, 'mean_length'), 0)} (own draws; real tokens counted)")
        rows.append(("gpu_generate_stops", value(ours, "tokens_per_second"), value(peer, "tokens_per_second"), "tokens/s", "higher",
                     value(ours, "tokens_per_second"), value(peer, "tokens_per_second"), value(ours, "peak"), value(peer, "peak"), note))
    if "grpo" in lines:
        ours, peer = results["grpo-ours"], results["grpo-trl"]
        same = (value(ours, "prompts") == value(peer, "prompts")) if value(ours, "prompts") and value(peer, "prompts") else None
        note = (f"{shape['prompts']} prompts x G={shape['group']} x {shape['new_tokens']} new tokens, beta {GRPO_BETA}"
                + ("" if same is None else ", same prompts" if same else ", PROMPTS DIFFER"))
        tokens = {k: value(r, "tokens") for k, r in (("ours", ours), ("peer", peer))}
        expected = shape["prompts"] * shape["group"] * shape["new_tokens"]
        if any(t is not None and any(x != expected for x in t) for t in tokens.values()):
            note += f", TOKENS PER STEP NOT {expected}: ours {tokens['ours']} TRL {tokens['peer']}"
        rows.append(("gpu_grpo", value(ours, "seconds"), value(peer, "seconds"), "s/step", "lower",
                     value(ours, "tokens_per_second"), value(peer, "tokens_per_second"), value(ours, "peak"), value(peer, "peak"), note))
    if "dpo" in lines:
        ours, peer = results["dpo-ours"], results["dpo-trl"]
        note = f"{shape['pairs']} pairs, prompt {shape['pair_prompt']} + 2 x {shape['pair_response']} tokens, beta {DPO_BETA}, live reference"
        rows.append(("gpu_dpo", value(ours, "seconds"), value(peer, "seconds"), "s/step", "lower",
                     value(ours, "tokens_per_second"), value(peer, "tokens_per_second"), value(ours, "peak"), value(peer, "peak"), note))
    print(f"| line | ours | peer (TRL / generate) | unit | ratio (> 1: ours better) | ours tokens/s | peer tokens/s | ours {memory} | peer {memory} | setting |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results_lines = []
    for name, ours, peer, unit, better, ours_rate, peer_rate, ours_peak, peer_peak, note in rows:
        ratio = None if ours is None or peer is None else (peer / ours if better == "lower" else ours / peer)
        digits = 1 if unit == "tokens/s" else 3
        print(f"| {name} | {fmt(ours, digits)} | {fmt(peer, digits)} | {unit} | {fmt(ratio, 2)} | {fmt(ours_rate, 0)} | {fmt(peer_rate, 0)} | "
              f"{fmt(ours_peak, 2)} | {fmt(peer_peak, 2)} | {note} |")
        results_lines.append(f"RESULT {name}: ours={fmt(ours, digits)} peer={fmt(peer, digits)} unit={unit} ratio={fmt(ratio, 2)} "
                             f"commit={commit}")
    print("\n".join(results_lines), flush=True)


if __name__ == "__main__":
    main()
