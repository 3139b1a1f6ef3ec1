"""The loss link: one module per family, each a `step(models, batch, settings, world) -> metrics`
that runs one optimizer step (or, for the policy gradient, the step's epochs of mini-batches) and
never sees a whole recipe config. A family's per-row inputs ride in its batch (a preference batch's
cached reference log-probs and KTO labels, a reward-model batch's margins); its settings are a small
dataclass (the loss section and the micro-batch size).

- `sft`: masked NLL of the response tokens (`SFTSettings`).
- `preference`: the preference objectives on pairs (the DPO family, SimPO, CPO, ORPO) or unpaired rows
  (KTO, `kto`), each an entry of the table in `objectives` through which `preference.step`
  dispatches (`PreferenceSettings`).
- `reward_model`: Bradley-Terry on a reward model's scalar rewards of each pair (`RewardModelSettings`).
- `policy_gradient`: `prepare` (the old / reference log-probs, the critic's values, the KL in the
  reward, the estimator's advantages: an `UpdateBatch` from a scored batch) and `step` (the exact KL,
  the surrogate over rollouts: GRPO, PPO; TIS, KL in the loss, the value loss; the sampler mismatch),
  both on `PolicyModels` and `UpdateSettings`.

The pure tensor math each step calls lives in `posttrain/algorithms/`; the recipes in
`posttrain/recipes/` build the models, the batch and the settings and call the step.
"""
