"""Reward models, ours vs the peers, side by side in one run: one Bradley-Terry training step (ours vs
TRL's RewardTrainer: seconds and peak RSS) and `rm:DIR` scoring throughput (ours vs transformers'
AutoModelForSequenceClassification).

Setting: SmolLM2-135M-Instruct (`--model tiny` for a smoke run), float32, CPU, one torch thread per
process by default (bench/dpo.py's reason: on the shared 2-core machine two OpenMP threads measure
the neighbours). Both reward models start from the same weights: the parent process builds
`RewardModel.from_policy(load_policy(model), seed)` (what `rm.setup` builds) and `export`s it; TRL
loads that directory with `AutoModelForSequenceClassification` (num_labels 1), while our side
rebuilds it through the recipe (the same seeded head).

1. Training step. The same pairs on both sides (arithmetic, plain string prompts without a chat
   template so both tokenise alike: ours `prompt ids + response ids + EOS`, TRL `prompt + chosen +
   eos_token` as one string; the ids are equal for these rows), 8 pairs per optimizer step in the
   same order (TRL's sampler `sequential` over the rows in the order our seeded stream draws them),
   tokenised in the step on our side (TRL tokenises its whole dataset at set-up, timed apart), no
   truncation on either side (data.max_*_tokens None, TRL max_length None), AdamW (fused on both)
   at lr 1e-4, constant schedule, no weight decay, clipping at 1.0, no centering (ours
   loss.centering 0, TRL center_rewards_coefficient None), no gradient checkpointing and float32
   (TRL's defaults are gradient_checkpointing=True and bf16=True: both set off here). Ours is the
   recipe's own `rm.setup` + `rm.build_trainer` + `rm.step` (what `posttrain rm` runs each step, without
   the run directory, evaluation and checkpoints); TRL is `RewardTrainer.train()` timed between
   `on_step_end` callbacks. Each side runs in its own process (its peak RSS is its own), the steps
   interleaved as in bench/grpo.py (one side steps while the other waits, the first to go alternating,
   so a shared machine's load falls on both alike; `--sequential`: one side after the other):
   `warmup` steps, then `steps` timed ones, the median reported. The benchmark fails unless both sides saw the
   same pairs and token counts in every step and their first-step losses (same weights, same batch)
   agree within 1e-4.

2. Scoring. `--completions` (prompt, completion) rows scored by `RewardModelVerifier` (`rm:DIR`, the
   export above, batch_size 16: it renders each row with the reward model's tokenizer and one EOS,
   right-pads and pools at the last attended token) vs the same texts (`prompt + completion +
   eos_token`) through the exported directory's tokenizer (padding, right side) and
   AutoModelForSequenceClassification in batches of 16 under torch.no_grad. Both in this process, a
   warm-up pass each, then `repeats` alternating passes, the median. The raw rewards must agree
   within 1e-4 before anything is timed.

    .venv/bin/python bench/rm.py [--steps 3] [--warmup 1] [--repeats 3] [--completions 64] [--threads 1] [--sequential] [--model smollm2-135m]

Beside each side's wall seconds per step, its CPU seconds per step (median, the process's own CPU
time: both sides are single-threaded, so on an idle machine the two agree, and on a loaded one the
CPU seconds still compare the work), and on the line before the RESULT lines their ratio (TRL/ours)
and both first-step losses in full (equal to the bit, or how far apart).

The last three lines are `RESULT rm_step: ... unit=s/step ratio=R` (R = peer/ours),
`RESULT rm_step_memory: ... unit=MiB ratio=R` (peak RSS, R = peer/ours) and
`RESULT rm_scoring: ... unit=completions/s ratio=R` (R = ours/peer): R > 1 means we are better.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import grpo  # noqa: E402  bench/grpo.py: the step gate between the sides, its process per side
from grpo import gated_clock, memory_available_mb, step_done, step_gate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BATCH = 8
LR = 1e-4
SCORE_BATCH = 16
LOSS_TOLERANCE = 1e-4
SCORE_TOLERANCE = 1e-4


def make_pairs(count: int) -> list[dict]:
    """Arithmetic preference pairs: the right sum in <answer> tags vs a wrong one."""
    rows = []
    for index in range(count):
        a, b = 17 * index + 23, 31 * index + 11
        wrong = a + b + 10 * (index % 3 + 1)
        rows.append({"id": f"p{index}", "prompt": f"Question {index}: what is {a}+{b}? Put the answer in <answer></answer> tags.\n",
                     "chosen": f"{a} plus {b} is {a + b}. <answer>{a + b}</answer>",
                     "rejected": f"{a} plus {b} is about {wrong}. <answer>{wrong}</answer>"})
    return rows


def make_completions(count: int) -> tuple[list[str], list[dict]]:
    """`count` (completion, row) pairs for scoring, four completions of different lengths per prompt."""
    completions, rows = [], []
    for index in range(count):
        question = index // 4
        a, b = 13 * question + 7, 29 * question + 5
        completion = [f"<answer>{a + b}</answer>", f"<answer>{a + b + 1}</answer>",
                      f"{a} plus {b}: add the units, then the tens. That gives {a + b}. <answer>{a + b}</answer>",
                      f"I am not sure, perhaps {a * 2}? Let me guess instead. <answer>{a * 2}</answer>"][index % 4]
        completions.append(completion)
        rows.append({"prompt": f"Question {question}: what is {a}+{b}? Put the answer in <answer></answer> tags.\n"})
    return completions, rows


def rm_overrides(model: str, pairs_file: str, total: int) -> dict:
    """Our side's settings (posttrain rm's Config), as `posttrain rm --...` would give them."""
    return {"model": model, "seed": 0, "max_steps": total, "batch_size": BATCH, "micro_batch_size": BATCH,
            "hardware": {"device": "cpu", "precision": "fp32"},
            "data": {"pairs": pairs_file, "heldout_pairs": 0, "use_chat_template": False},
            "loss": {"centering": 0.0}, "optim": {"lr": LR, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0,
                                                   "max_grad_norm": 1.0}}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_ours(model: str, steps: int, warmup: int, workdir: Path) -> dict:
    import torch

    from posttrain.config import build_config
    from posttrain.recipes import rm
    from posttrain.runs.skeleton import start

    total = steps + warmup
    config = build_config(rm.Config, None, rm_overrides(model, str(workdir / "pairs.jsonl"), total))
    started = time.perf_counter()
    placement, world = start(config)
    state = rm.setup(config, world, placement)
    rm.build_trainer(state)
    setup_seconds = time.perf_counter() - started
    used: list[list[str]] = []
    tokens: list[int] = []
    encode = state.encode

    def recording(pairs):  # the pairs each step encodes (the seeded stream's) and their tokens, for the side-by-side check
        batch = encode(pairs)
        used.append([pair.id for pair in pairs])
        tokens.append(int(batch.chosen.attention_mask.sum() + batch.rejected.attention_mask.sum()))
        return batch

    state.encode = recording
    state.model.train()  # as rm.run does before its loop
    rss_before = rss_mib()
    durations, cpu, losses = [], [], []
    for done in range(1, total + 1):
        step_gate()
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics = rm.step(state, done)
        durations.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
        step_done()
        losses.append(metrics["loss"])
    return {"durations": durations, "cpu_seconds": cpu, "losses": losses, "pairs": used, "setup_seconds": setup_seconds,
            "rss_before_steps_mib": rss_before, "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(), "tokens": tokens}


def run_trl(steps: int, warmup: int, workdir: Path) -> dict:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    total = steps + warmup
    order = json.loads((workdir / "order.json").read_text())
    by_id = {row["id"]: row for row in map(json.loads, (workdir / "pairs.jsonl").read_text().splitlines())}
    dataset = datasets.Dataset.from_list([{key: by_id[i][key] for key in ("prompt", "chosen", "rejected")} for step in order for i in step])
    started = time.perf_counter()
    model = AutoModelForSequenceClassification.from_pretrained(workdir / "rm", dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(workdir / "rm", local_files_only=True)
    starts: list[float] = []
    marks: list[float] = []

    args = trl.RewardConfig(
        output_dir=str(workdir / "trl"), learning_rate=LR, max_steps=total, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1, max_length=None, center_rewards_coefficient=None, bf16=False, use_cpu=True,
        gradient_checkpointing=False, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        train_sampling_strategy="sequential", report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, dataset_num_proc=None,
    )
    cpu_marks: list[float] = []  # process time at the start and after each step (the gate's wait takes none)
    trainer = trl.RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                callbacks=[gated_clock(starts, marks, total), cpu_clock(cpu_marks)])
    setup_seconds = time.perf_counter() - started
    losses, tokens = [], []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, return_outputs=False, num_items_in_batch=None):
        tokens.append(int(inputs["attention_mask"].sum()))
        result = compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        losses.append(float((result[0] if return_outputs else result).detach()))
        return result

    trainer.compute_loss = recording
    rss_before = rss_mib()
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
    durations = [end - start for start, end in zip(starts, marks)]
    return {"durations": durations, "cpu_seconds": [b - a for a, b in zip(cpu_marks, cpu_marks[1:])], "losses": losses, "tokens": tokens,
            "setup_seconds": setup_seconds,
            "rss_before_steps_mib": rss_before, "peak_rss_mib": peak_rss_mib(), "threads": torch.get_num_threads(),
            "trl": trl.__version__, "optimizer": type(optimizer).__name__, "fused": bool(optimizer.param_groups[0].get("fused"))}


def cpu_clock(marks: list[float]):
    """A TrainerCallback appending the process's CPU time at train begin and at each step end, after
    `gated_clock` (which waits for the parent's `go` there, blocked, without CPU time): consecutive
    differences are each step's CPU seconds, which a loaded machine inflates far less than wall time."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            marks.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.process_time())

    return Clock()


class Side(grpo.Side):
    """grpo.Side (a training side in its own process, stepped through stdin/stdout), started on this file."""

    def __init__(self, name: str, arguments, workdir: Path):
        self.name = name
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, __file__, "--side", name, "--steps", str(arguments.steps), "--warmup", str(arguments.warmup),
                   "--model", arguments.model, "--threads", str(arguments.threads), "--workdir", str(workdir)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, cwd=ROOT, bufsize=1)


def run_sides(arguments, workdir: Path) -> dict[str, dict]:
    """Both training sides: set-up overlaps, then the steps one at a time, the first side to go
    alternating from step to step, so a shared machine's load falls on both alike (`--sequential`:
    each side to the end in turn). The 1-minute load average after each step is kept."""
    names = ["ours", "trl"]
    total = arguments.warmup + arguments.steps
    if arguments.sequential:
        results = {}
        for name in names:
            side, loads = Side(name, arguments, workdir), []
            for _ in range(total):
                side.step()
                loads.append(os.getloadavg()[0])
            results[name] = {**side.result(), "loads": loads}
        return results
    sides = [Side(name, arguments, workdir) for name in names]
    loads = {name: [] for name in names}
    for step in range(total):
        for side in sides if step % 2 == 0 else sides[::-1]:
            side.step()
            loads[side.name].append(os.getloadavg()[0])
    return {side.name: {**side.result(), "loads": loads[side.name]} for side in sides}


def prepare(arguments, workdir: Path) -> dict:
    """The pairs file, the order our seeded stream draws them in (TRL's dataset order), and the
    export of the freshly built reward model both sides start from. Returns the settings used."""
    from posttrain.config import build_config
    from posttrain.data.stream import data_order
    from posttrain.hardware import resolve
    from posttrain.models.loading import load_policy
    from posttrain.models.reward_model import RewardModel, export
    from posttrain.recipes import rm

    total = arguments.steps + arguments.warmup
    pairs = make_pairs(BATCH * total)
    (workdir / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in pairs))
    config = build_config(rm.Config, None, rm_overrides(arguments.model, str(workdir / "pairs.jsonl"), total))
    order = [[pairs[i]["id"] for i in data_order(len(pairs), config.seed, step * BATCH, BATCH)] for step in range(total)]
    (workdir / "order.json").write_text(json.dumps(order))
    policy, tokenizer = load_policy(config.model, config.lora_rank, config.lora_alpha, resolve(config.hardware))
    model = RewardModel.from_policy(policy, seed=config.seed)  # what rm.setup builds
    export(model, tokenizer, workdir / "rm", {"reward_mean": 0.0, "reward_std_population": 1.0, "system_prompt": None,
                                              "use_chat_template": False, "base_model": config.model, "steps": 0})
    return {"order": order, "seed": config.seed}


def check_training(ours: dict, peer: dict, order: list[list[str]]) -> float:
    """Both sides trained on the same pairs (ours: the pairs its steps encoded = the order TRL was
    given; the same token counts per step) and agree on the first step's loss. Returns max |loss
    difference| over the steps."""
    if ours["pairs"] != order:
        raise SystemExit(f"our steps encoded other pairs than TRL was given: {ours['pairs']} vs {order}")
    if ours["tokens"] != peer["tokens"]:
        raise SystemExit(f"tokens per step differ: ours {ours['tokens']}, TRL {peer['tokens']} (tokenisation differs)")
    difference = abs(ours["losses"][0] - peer["losses"][0])
    if difference > LOSS_TOLERANCE:
        raise SystemExit(f"first-step losses differ by {difference:.2e} (ours {ours['losses'][0]:.6f}, TRL {peer['losses'][0]:.6f}): "
                         "not the same weights or batch")
    return max(abs(a - b) for a, b in zip(ours["losses"], peer["losses"]))


def run_scoring(arguments, workdir: Path) -> dict:
    """Completions per second of `rm:DIR` (ours) vs AutoModelForSequenceClassification on the same
    texts (peer), after checking that their raw rewards agree."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.rewards.reward_model import RewardModelVerifier

    completions, rows = make_completions(arguments.completions)
    verifier = RewardModelVerifier(str(workdir / "rm"), batch_size=SCORE_BATCH, normalisation="none")
    model = AutoModelForSequenceClassification.from_pretrained(workdir / "rm", dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(workdir / "rm", local_files_only=True)
    tokenizer.padding_side = "right"  # transformers' pooling finds the last non-pad token; positions count from the left
    texts = [row["prompt"] + completion + tokenizer.eos_token for completion, row in zip(completions, rows)]

    def ours() -> torch.Tensor:
        verdicts = verifier.batch(completions, rows)
        return torch.tensor([verdict.details["raw"] for verdict in verdicts])

    @torch.no_grad()
    def peer() -> torch.Tensor:
        out = []
        for start in range(0, len(texts), SCORE_BATCH):
            batch = tokenizer(texts[start : start + SCORE_BATCH], padding=True, return_tensors="pt")
            out.append(model(**batch).logits.squeeze(-1).float())
        return torch.cat(out)

    a, b = ours(), peer()  # also the warm-up pass of each
    if a.shape != b.shape or not torch.allclose(a, b, rtol=0, atol=SCORE_TOLERANCE):
        worst = (a - b).abs().max().item() if a.shape == b.shape else float("nan")
        raise SystemExit(f"rm scoring: ours and transformers' rewards differ (max |difference| {worst:.2e} > {SCORE_TOLERANCE}):\n"
                         f"ours {a[:8].tolist()}\ntransformers {b[:8].tolist()}")
    tokens = sum(len(verifier.render(c, r)[0]) for c, r in zip(completions, rows))
    seconds = {"ours": [], "peer": []}
    for repeat in range(arguments.repeats):
        for name, function in ((("ours", ours), ("peer", peer)) if repeat % 2 == 0 else (("peer", peer), ("ours", ours))):
            started = time.perf_counter()
            function()
            seconds[name].append(time.perf_counter() - started)
    return {"seconds": seconds, "max_difference": (a - b).abs().max().item(), "tokens": tokens,
            "reward_range": [a.min().item(), a.max().item()]}


def cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per side (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed training steps first")
    parser.add_argument("--repeats", type=int, default=3, help="timed scoring passes per side (median reported)")
    parser.add_argument("--completions", type=int, default=64, help="completions per scoring pass")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads in every process (0: torch's default)")
    parser.add_argument("--sequential", action="store_true", help="one training side after the other instead of interleaved steps")
    parser.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.steps < 1 or arguments.warmup < 0 or arguments.repeats < 1 or arguments.completions < 1:
        parser.error("--steps, --repeats and --completions must be >= 1, --warmup >= 0")
    import torch

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    if arguments.side:
        workdir = Path(arguments.workdir)
        result = run_ours(arguments.model, arguments.steps, arguments.warmup, workdir) if arguments.side == "ours" \
            else run_trl(arguments.steps, arguments.warmup, workdir)
        print("@@result " + json.dumps(result), flush=True)
        return
    if not arguments.sequential and memory_available_mb() < 9000:
        print(f"only {memory_available_mb():.0f} MB available: running the training sides one after the other", flush=True)
        arguments.sequential = True
    load_before, wall = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        workdir = Path(directory)
        plan = prepare(arguments, workdir)
        results = run_sides(arguments, workdir)
        for name in ("ours", "trl"):
            print(f"side {name}: {json.dumps({k: v for k, v in results[name].items() if k != 'pairs'})}", flush=True)
        ours, peer = results["ours"], results["trl"]
        loss_difference = check_training(ours, peer, plan["order"])
        scoring = run_scoring(arguments, workdir)
    load_after, wall = os.getloadavg(), time.perf_counter() - wall
    timed = slice(arguments.warmup, None)
    ours_step, peer_step = statistics.median(ours["durations"][timed]), statistics.median(peer["durations"][timed])
    ours_score = arguments.completions / statistics.median(scoring["seconds"]["ours"])
    peer_score = arguments.completions / statistics.median(scoring["seconds"]["peer"])
    print(f"date {datetime.date.today()}, machine {platform.machine()} {cpu_model()}, {os.cpu_count()} CPUs, "
          f"{ours['threads']} torch threads, torch {torch.__version__}, trl {peer['trl']}, python {platform.python_version()}; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; {wall:.0f} s in all")
    print(f"model {arguments.model} float32 CPU; training: {BATCH} pairs/step (~{statistics.mean(ours['tokens']):.0f} tokens/step), "
          f"AdamW lr {LR} (TRL: {peer['optimizer']}{' fused' if peer['fused'] else ''}), {arguments.warmup} warm-up + {arguments.steps} "
          f"timed steps, median, {'sequential' if arguments.sequential else 'steps interleaved'}; same pairs and tokens every step, first-step loss within {LOSS_TOLERANCE:g} (max |loss diff| over the steps "
          f"{loss_difference:.1e}); scoring: {arguments.completions} completions (~{scoring['tokens'] / arguments.completions:.0f} "
          f"tokens each), batches of {SCORE_BATCH}, {arguments.repeats} passes, median; raw rewards equal "
          f"(max |diff| {scoring['max_difference']:.1e})")
    print(f"{'training step':<14} {'s/step':>7} {'best':>6} {'CPU s':>6} {'setup s':>8} {'RSS at step 1 MiB':>17} {'peak RSS MiB':>12}  "
          f"{'losses':<30} all steps s (1-min load after each)")
    for label, result in (("ours", ours), ("TRL", peer)):
        print(f"{label:<14} {statistics.median(result['durations'][timed]):>7.3f} {min(result['durations'][timed]):>6.3f} "
              f"{statistics.median(result['cpu_seconds'][timed]):>6.3f} "
              f"{result['setup_seconds']:>8.1f} {result['rss_before_steps_mib']:>17.0f} {result['peak_rss_mib']:>12.0f}  "
              f"{' '.join(f'{loss:.4f}' for loss in result['losses']):<30} {' '.join(f'{s:.2f} ({load:.1f})' for s, load in zip(result['durations'], result['loads']))}")
    print(f"{'scoring':<14} {'completions/s':>13}  all passes s")
    for label, name, rate in (("ours (rm:DIR)", "ours", ours_score), ("transformers", "peer", peer_score)):
        print(f"{label:<14} {rate:>13.1f}  {' '.join(f'{s:.2f}' for s in scoring['seconds'][name])}")
    ours_cpu, peer_cpu = statistics.median(ours["cpu_seconds"][timed]), statistics.median(peer["cpu_seconds"][timed])
    first = "equal to the bit" if ours["losses"][0] == peer["losses"][0] else f"{abs(ours['losses'][0] - peer['losses'][0]):.1e} apart"
    print(f"CPU seconds per step (median): ours {ours_cpu:.3f}, TRL {peer_cpu:.3f}, cpu ratio {peer_cpu / ours_cpu:.2f}; "
          f"first-step loss ours {ours['losses'][0]!r}, TRL {peer['losses'][0]!r} ({first})")
    print(f"RESULT rm_step: ours={ours_step:.3f} peer={peer_step:.3f} unit=s/step ratio={peer_step / ours_step:.2f}")
    print(f"RESULT rm_step_memory: ours={ours['peak_rss_mib']:.0f} peer={peer['peak_rss_mib']:.0f} unit=MiB "
          f"ratio={peer['peak_rss_mib'] / ours['peak_rss_mib']:.2f}")
    print(f"RESULT rm_scoring: ours={ours_score:.1f} peer={peer_score:.1f} unit=completions/s ratio={ours_score / peer_score:.2f}")


if __name__ == "__main__":
    main()
