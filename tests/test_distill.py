"""On-policy distillation: the teacher's per-token reward (`teacher:MODEL`, `algorithms/distill.py`),
the `distill` estimator and how the other estimators read a dense reward, the loss link's token
rewards against the student's log-probs, and whole runs: teacher = student gives reward exactly 0 and
no gradient, the teacher is never updated, a mismatched tokenizer is one line before any work."""

import json
import math

import pytest
import torch

from posttrain.algorithms.advantages import discounted_returns, reinforce_returns
from posttrain.algorithms.distill import reverse_kl_per_token, teacher_token_rewards
from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS, StepRewards
from posttrain.config import build_config, parse_overrides
from posttrain.errors import UserError
from posttrain.models.reward_model import weights_hash
from posttrain.models.tiny import build_tiny_model
from posttrain.recipes import online as grpo
from posttrain.recipes import online_config
from posttrain.rewards.teacher import TeacherReward, teacher_directory

SMALL = ["--data.eval_size", "8", "--data.train_size", "200", "--data.prompts_per_step", "2", "--data.group_size", "4",
         "--sampling.max_new_tokens", "6", "--update.micro_batch_size", "8", "--optim.lr", "1e-3", "--reward_options.batch_size", "8"]


def small_config(tmp_path, *extra) -> online_config.Config:
    config = build_config(online_config.grpo_config, None, parse_overrides(SMALL + list(extra)))
    config.output_dir = str(tmp_path / "run")
    return config


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher unlike the student `tiny`: the tiny architecture with other random weights, saved as a model directory."""
    torch.manual_seed(1)
    model, tokenizer = build_tiny_model()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    directory = tmp_path_factory.mktemp("teacher") / "final"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- the math, by hand ------------------------------------------------------------------------------------

def test_two_token_teacher_reward_by_hand():
    # teacher p = (0.5, 0.25), student p = (0.25, 0.5): r = (log 2, -log 2), reverse KL estimate 0 on average
    teacher = torch.log(torch.tensor([[0.5, 0.25]]))
    student = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.tensor([[True, True]])
    rewards = teacher_token_rewards(teacher, student, mask)
    assert torch.allclose(rewards, torch.tensor([[math.log(2), -math.log(2)]]))
    assert float(reverse_kl_per_token(teacher, student, mask)) == pytest.approx(0.0, abs=1e-7)
    half = teacher_token_rewards(teacher, student, torch.tensor([[True, False]]), weight=0.5)
    assert torch.allclose(half, torch.tensor([[0.5 * math.log(2), 0.0]]))


def test_docstring_example_three_tokens():
    rewards = teacher_token_rewards(torch.tensor([[-0.5, -1.0, -0.2]]), torch.tensor([[-0.7, -0.4, -0.2]]), torch.ones(1, 3, dtype=torch.bool))
    assert torch.allclose(rewards, torch.tensor([[0.2, -0.6, 0.0]]))
    assert float(reverse_kl_per_token(torch.tensor([[-0.5, -1.0, -0.2]]), torch.tensor([[-0.7, -0.4, -0.2]]),
                                      torch.ones(1, 3, dtype=torch.bool))) == pytest.approx(0.4 / 3)


def test_discounted_returns_skip_uncounted_tokens():
    rewards = torch.tensor([[0.3, 9.0, -0.6, 0.4]])
    mask = torch.tensor([[True, False, True, True]])  # the second token is a tool's observation
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), torch.tensor([[0.1, 0.0, -0.4, 0.4]]))
    assert torch.allclose(discounted_returns(rewards, mask, 0.0), torch.tensor([[0.3, 0.0, -0.6, 0.4]]))
    assert torch.equal(discounted_returns(rewards, mask, 1.0), reinforce_returns(rewards, mask))


def _inputs(**extra):
    mask = torch.tensor([[True, True, False], [True, True, True]])
    return StepRewards(rewards=torch.tensor([1.0, 0.0]), mask=mask, sampled=mask, group_size=2,
                       token_rewards=torch.tensor([[0.2, -0.6, 0.0], [0.1, 0.1, -0.5]]), **extra)


def test_distill_estimator_by_hand():
    entry = ADVANTAGE_ESTIMATORS["distill"]
    own = entry.estimate(_inputs(), discount=0.0, baseline="none").advantages
    assert torch.allclose(own, torch.tensor([[1.2, 0.4, 0.0], [0.1, 0.1, -0.5]]))
    grouped = entry.estimate(_inputs(), discount=0.0, baseline="group").advantages  # R - group mean: +0.5, -0.5
    assert torch.allclose(grouped, torch.tensor([[0.7, -0.1, 0.0], [-0.4, -0.4, -1.0]]))
    to_go = entry.estimate(_inputs(), discount=1.0, baseline="none").advantages
    assert torch.allclose(to_go, torch.tensor([[0.6, 0.4, 0.0], [-0.3, -0.4, -0.5]]))
    kl = torch.tensor([[1.0, 1.0, 1.0], [0.0, 2.0, 0.0]])
    penalised = entry.estimate(_inputs(kl=kl, kl_beta=0.1), discount=0.0, baseline="none").advantages
    assert torch.allclose(penalised, own - 0.1 * kl * _inputs().mask)


def test_sequence_estimators_sum_the_dense_reward():
    # group: rewards 1 + (-0.4) = 0.6 and 0 + (-0.3) = -0.3 -> scale none: +-0.45
    group = ADVANTAGE_ESTIMATORS["group"].estimate(_inputs(), scale="none", eps=1e-6, unbiased_std=False).advantages
    assert torch.allclose(group, torch.tensor([0.45, -0.45]))
    rloo = ADVANTAGE_ESTIMATORS["rloo"].estimate(_inputs()).advantages
    assert torch.allclose(rloo, torch.tensor([0.9, -0.9]))
    # reinforce_pp unwhitened: each token's reward + R on the last counted token, summed to go
    returns = ADVANTAGE_ESTIMATORS["reinforce_pp"].estimate(_inputs(), whiten=False).advantages
    assert torch.allclose(returns, torch.tensor([[0.6, 0.4, 0.0], [-0.3, -0.4, -0.5]]))


def test_without_a_dense_reward_nothing_changes():
    plain = StepRewards(rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3, dtype=torch.bool),
                        sampled=torch.ones(2, 3, dtype=torch.bool), group_size=2)
    zero = StepRewards(rewards=torch.tensor([1.0, 0.0]), mask=torch.ones(2, 3, dtype=torch.bool),
                       sampled=torch.ones(2, 3, dtype=torch.bool), group_size=2, token_rewards=torch.zeros(2, 3))
    for name, settings in (("group", {"scale": "group", "eps": 1e-6, "unbiased_std": False}), ("rloo", {}),
                           ("reinforce_pp", {"whiten": True})):
        entry = ADVANTAGE_ESTIMATORS[name]
        assert torch.equal(entry.estimate(plain, **settings).advantages, entry.estimate(zero, **settings).advantages)


# --- the teacher -----------------------------------------------------------------------------------------

def test_teacher_equal_to_student_gives_zero_reward_and_no_gradient(tmp_path):
    config = small_config(tmp_path, "--reward", "teacher:tiny", "--loss.advantage", "distill")
    state = grpo.setup(config)
    batch = grpo.sample(state)
    assert len(batch.scores.dense) == 1 and batch.scores.dense[0].logprobs.shape == batch.rollout.mask.shape
    assert torch.all(batch.scores.rewards == 0)  # the sequence part of a teacher alone
    before = {name: p.detach().clone() for name, p in state.policy.named_parameters()}
    metrics = grpo.step(state, batch)
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["distill/token_reward"] == 0.0
    assert metrics["grad_norm"] == 0.0 and metrics["loss"] == 0.0
    assert all(torch.equal(before[name], p) for name, p in state.policy.named_parameters())


def test_teacher_is_never_updated_and_the_student_moves(tmp_path, teacher_dir):
    config = small_config(tmp_path, "--reward", f"teacher:{teacher_dir}", "--loss.advantage", "distill")
    state = grpo.setup(config)
    teacher = state.verifier
    assert isinstance(teacher, TeacherReward) and not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())
    hashed = weights_hash(teacher.model)
    student = weights_hash(state.policy)
    for _ in range(2):
        metrics = grpo.step(state, grpo.sample(state))
    assert weights_hash(teacher.model) == hashed
    assert weights_hash(state.policy) != student
    assert metrics["distill/reverse_kl"] > 0 and metrics["grad_norm"] > 0
    assert metrics["distill/teacher_logprob"] < 0


def test_token_rewards_are_the_teacher_minus_the_student_on_the_loss_mask(tmp_path, teacher_dir):
    from posttrain.losses.policy_gradient import prepare
    from posttrain.models.forward import completion_logprobs

    config = small_config(tmp_path, "--reward", f"teacher:{teacher_dir}", "--loss.advantage", "distill")
    state = grpo.setup(config)
    batch = grpo.sample(state)
    models, settings = grpo.loss_inputs(state)
    update, metrics = prepare(models, batch, settings, state.world)
    rollout = batch.rollout
    student = completion_logprobs(state.policy, rollout, rollout.forward_inputs(), 1.0, 8)
    teacher = completion_logprobs(state.verifier.model, rollout, rollout.forward_inputs(), 1.0, 8)
    expected = torch.where(update.mask, teacher - student, torch.zeros_like(student))
    assert torch.allclose(update.advantages, expected, atol=1e-5)  # discount 0, no task reward: each token's own
    assert metrics["distill/reverse_kl"] == pytest.approx(float((student - teacher)[update.mask].mean()), abs=1e-5)
    assert update.old_logprobs is None  # the reward read its own forward: the loss link is GRPO's, ratio exactly 1


def test_mixed_reward_weights_teacher_and_task(tmp_path, teacher_dir):
    config = small_config(tmp_path, "--reward", f"0.5*teacher:{teacher_dir}+exact", "--loss.advantage", "distill")
    state = grpo.setup(config)
    batch = grpo.sample(state)
    assert [term.weight for term in batch.scores.dense] == [0.5]
    parts = [verdict.details["components"] for verdict in batch.scores.verdicts]
    assert all(part[f"teacher:{teacher_dir}"] == 0.0 for part in parts)  # the sequence part is exact's alone
    assert batch.scores.rewards.tolist() == [part["exact"] for part in parts]


def test_tokenizer_mismatch_is_one_line_before_any_work(tmp_path):
    model, tokenizer = build_tiny_model()
    tokenizer.add_tokens(["<extra-token>"])
    model.resize_token_embeddings(len(tokenizer))
    directory = tmp_path / "other"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    config = small_config(tmp_path, "--reward", f"teacher:{directory}")
    with pytest.raises(UserError, match="tokenizer differs from the policy's"):
        grpo.run(config)
    assert not (tmp_path / "run").exists()


def test_run_directory_means_its_final_export(tmp_path):
    (tmp_path / "run" / "final").mkdir(parents=True)
    assert teacher_directory(str(tmp_path / "run")) == str(tmp_path / "run" / "final")
    assert teacher_directory("tiny") == "tiny"


def test_dynamic_sampling_with_a_teacher_is_refused(tmp_path):
    config = small_config(tmp_path, "--reward", "teacher:tiny", "--data.dynamic_sampling", "true")
    with pytest.raises(UserError, match="data.dynamic_sampling"):
        grpo.setup(config)


def test_whole_run_logs_the_distillation_and_the_teachers_score(tmp_path, teacher_dir):
    config = small_config(tmp_path, "--reward", f"teacher:{teacher_dir}", "--loss.advantage", "distill", "--max-steps", "2")
    run_dir = grpo.run(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(row["distill/reverse_kl"] > 0 for row in rows if "distill/reverse_kl" in row)
    assert sum("distill/reverse_kl" in row for row in rows) == 2
    card = json.loads((run_dir / "run_card.json").read_text())
    reward = card["links"]["reward"]
    assert reward["verifier"] == f"teacher:{teacher_dir}" and "log p_teacher - log p_student" in reward["dense"]
    assert set(reward["teacher_heldout"][f"teacher:{teacher_dir}"]) == {"pass@1", "pass@1_ci95", "n"}
    assert card["links"]["loss"]["old_logprobs"].startswith("the on-policy forward")  # the teacher changes the reward link only
    assert card["links"]["loss"]["algorithm"].startswith("On-policy distillation")
    # The sequence rewards are all 0 (every group "without variance"): the teacher's token rewards are the signal.
    assert card["training_signal"]["steps_without_reward_signal"] == 0
    assert card["training_signal"]["zero_variance_group_fraction"] is None


def test_lora_student_learns_from_the_teacher_with_its_base_untouched(tmp_path, teacher_dir):
    config = small_config(tmp_path, "--reward", f"teacher:{teacher_dir}", "--loss.advantage", "distill", "--lora_rank", "4")
    state = grpo.setup(config)
    named = lambda trainable: {n: p.detach().clone() for n, p in state.policy.named_parameters() if p.requires_grad == trainable}  # noqa: E731
    adapters, base, teacher = named(True), named(False), weights_hash(state.verifier.model)
    assert adapters and base
    for _ in range(2):
        metrics = grpo.step(state, grpo.sample(state))
    assert metrics["distill/reverse_kl"] > 0 and metrics["grad_norm"] > 0
    assert any(not torch.equal(adapters[n], p) for n, p in state.policy.named_parameters() if n in adapters)
    assert all(torch.equal(base[n], p) for n, p in state.policy.named_parameters() if n in base)
    assert weights_hash(state.verifier.model) == teacher


def test_tool_observations_get_no_teacher_reward(teacher_dir):
    """A scripted two-turn episode (a call, the tool's observation, an answer; tests/test_episodes.py):
    the teacher reads the policy's tokens only, and the observation's tokens get no reward."""
    from posttrain.distributed import World
    from posttrain.losses.policy_gradient import dense_rewards
    from posttrain.models.forward import completion_logprobs
    from tests.test_episodes import run as episode

    model, tokenizer = build_tiny_model()
    rollout = episode(tokenizer, model)
    observation = rollout.attention & ~rollout.mask
    assert observation.any() and rollout.mask.any()
    teacher = TeacherReward(str(teacher_dir), tokenizer=tokenizer, batch_size=4)
    [term] = teacher.token_terms(rollout, torch.zeros(1, dtype=torch.long), World())
    assert torch.all(term.logprobs[observation] == 0) and torch.all(term.logprobs[rollout.mask] < 0)
    student = completion_logprobs(model, rollout, rollout.forward_inputs(), 1.0, 4)
    metrics = {}
    rewards = dense_rewards([term], student, rollout.mask, metrics)
    assert torch.all(rewards[observation] == 0)
    assert torch.allclose(rewards[rollout.mask], (term.logprobs - student)[rollout.mask])
    assert metrics["distill/reverse_kl"] == pytest.approx(float((student - term.logprobs)[rollout.mask].mean()), abs=1e-6)


def test_asynchronous_generation_scores_with_the_teacher(tmp_path):
    """Mode (b): the generation thread samples with the worker engine and the teacher scores its batches
    there; step 1's batch comes from the start's weights, which the teacher `tiny` shares: reward exactly 0."""
    config = small_config(tmp_path, "--reward", "teacher:tiny", "--loss.advantage", "distill", "--max-steps", "3",
                          "--data.max_staleness", "1", "--data.async_generation", "true")
    run_dir = grpo.run(config)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"distill/reverse_kl"' in line]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[0]["distill/reverse_kl"] == 0.0 and rows[0]["offpolicy/staleness_max"] == 0
    assert all(row["offpolicy/staleness_max"] <= 1 for row in rows)
    card = json.loads((run_dir / "run_card.json").read_text())
    assert card["links"]["data"]["engine"]["name"] == "worker"  # the built-in engine in its own process
