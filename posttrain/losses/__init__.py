"""The loss link: one module per family, each a `step(models, batch, settings, world) -> metrics`
that runs one optimizer step (or, for the policy gradient, the step's epochs of mini-batches) and
never sees a whole recipe config.

- `sft`: masked NLL of the response tokens.
- `preference`: the DPO family on pairs of chosen / rejected responses against a reference.
- `policy_gradient`: the clipped surrogate over rollouts (GRPO, PPO; TIS, KL in the loss, the value loss).

The pure tensor math each step calls lives in `posttrain/algorithms/`; the recipes in
`posttrain/recipes/` build the models, the batch and the settings and call the step.
"""
