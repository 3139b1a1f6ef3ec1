"""The run card of an online run (`posttrain grpo`, `posttrain ppo`): the four links, each written by
its link's home (the data link's record with the engine that sampled and, for stale batches, what
the loss made of them; the reward as it describes itself; the loss card; acceptance), and the run's
own part."""

from __future__ import annotations

import dataclasses
from typing import Any

from posttrain.algorithms.estimators import ADVANTAGE_ESTIMATORS
from posttrain.config import to_dict
from posttrain.data.scored_batch import online_data_card
from posttrain.evaluation.acceptance import acceptance_card
from posttrain.losses.policy_gradient_config import loss_card, off_policy_meaning
from posttrain.recipes.online_config import Config, sampling_engine
from posttrain.rollout.engines import engine_card
from posttrain.runs import new_card
from posttrain.runs.skeleton import card_run_part

def make_card(config: Config, state, reward: Any, changes: list[str] = ()) -> dict[str, Any]:
    """The run card: the four links, each written by its link's home, and the run's own part (with
    `changes`, what a resume accepted). `state`: the recipe's `online.State`."""
    estimator = ADVANTAGE_ESTIMATORS[config.loss.advantage]
    card = new_card(estimator.command, config.seed, model=config.model, lora_rank=config.lora_rank, config=to_dict(config))
    card["run"]["reference_refreshed_at"] = list(state.reference_refreshed_at)
    card["links"]["data"] = online_data_card(config.data, state.train, state.held_out, config.sampling,
                                             grouped=estimator.min_group_size > 1 or config.data.group_size > 1, screening=state.screening)
    card["links"]["data"]["engine"] = engine_card(sampling_engine(config))
    if config.tools.enabled:
        from posttrain.rollout.episodes import tools_card

        card["links"]["data"]["episodes"] = tools_card(config.tools, state.sampler.toolbox)
    card["links"]["reward"] = reward_link(config, state, reward)
    # The loss link states the setting (auto's rule is the same whatever the data); what auto resolved to
    # for these batches goes with them, so that a change of data.max_staleness alone is a data-link change.
    card["links"]["loss"] = loss_card(config.loss, config.critic, config.update, config.sampling, state.reference)
    if config.data.max_staleness:
        card["links"]["data"]["staleness_correction"] = off_policy_meaning(config.loss, config.data.max_staleness)
    acceptance = card["links"]["acceptance"] = acceptance_card(dataclasses.asdict(config.acceptance), config.data.task,
                                                               len(state.held_out), state.verifier, state.checker, state.shifted)
    if not acceptance["independent"]:
        card["notes"].append(f"acceptance is not independent: {acceptance['independence_reason']}")
    card_run_part(card, config, state.placement, state.world, list(changes))
    return card


def reward_link(config: Config, state, reward: Any) -> dict[str, Any]:
    """The card's reward link: the verifier as it describes itself, whether it was passed as a
    Python object or named in the config, where the estimator puts it, DAPO's overlong shaping when on
    (`reward_options.overlong`: formula and values), and what resolved it."""
    link = {**state.verifier.describe(), "passed_as": "python object" if reward is not None else "config name"}
    placement = ADVANTAGE_ESTIMATORS[config.loss.advantage].reward_placement
    if placement is not None:
        link["placement"] = placement
    if config.reward_options.overlong.enabled:
        link["overlong"] = config.reward_options.overlong.card()
    link["resolved_from"] = (f"the task's gold format ({state.train.reward_kind})" if config.reward == "auto" and reward is None
                             else "set by the user")
    if state.verifier.dense:
        link["dense"] = ("per-token reward weight x (log p_teacher - log p_student) on each sampled token the loss reads "
                         "(tool observations and padding get none), the student's log-probs those of the policy before the update (a no-grad forward, or the loss's old log-probs when it fixes them); "
                         f"summed into each sequence's reward by loss.advantage {config.loss.advantage}"
                         if not ADVANTAGE_ESTIMATORS[config.loss.advantage].per_token else
                         "per-token reward weight x (log p_teacher - log p_student) on each sampled token the loss reads "
                         "(tool observations and padding get none), the student's log-probs those of the policy before the update (a no-grad forward, or the loss's old log-probs when it fixes them); "
                         f"each token's own in loss.advantage {config.loss.advantage}")
    return link


def teacher_heldout(config: Config, state) -> dict[str, Any]:
    """Each teacher's own held-out score, for reference beside the student's: greedy pass@1 by the
    run's held-out checker on the held-out split, sampled by the built-in engine in this process
    (an engine that holds the student's weights must not receive the teacher's), rank 0 only.
    Teacher name -> {pass@1, pass@1_ci95, n}; empty without a teacher."""
    from posttrain.evaluation.acceptance import evaluate_task
    from posttrain.rollout.engines import RolloutSettings, make_engine
    from posttrain.rollout.episodes import make_sampler

    teachers = [verifier for _, verifier in getattr(state.verifier, "components", [(1.0, state.verifier)]) if verifier.dense]
    if not teachers or not state.world.main:
        return {}
    sampler = make_sampler(config.tools, state.tokenizer, config.reward_options.sandbox(config.unsafe_no_sandbox),
                           make_engine(RolloutSettings()))
    scores = {}
    with state.placement.autocast():
        for teacher in teachers:
            teacher.model.to(state.placement.device)
            result = evaluate_task(teacher.model, state.tokenizer, state.held_out, checker=state.checker, temperature=config.sampling.temperature,
                                   max_new_tokens=config.acceptance.max_new_tokens or config.sampling.max_new_tokens, seed=config.seed,
                                   system_prompt=config.data.system_prompt, sampler=sampler, label=f"teacher {teacher.name}")
            if teacher.offload:
                teacher.model.to("cpu")
            scores[teacher.name] = {key: result.get(key) for key in ("pass@1", "pass@1_ci95", "n")}
    return scores
