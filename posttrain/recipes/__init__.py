"""The recipes: orchestration only. Each builds the four links from its config, runs its numbered
step loop on the run skeleton (`posttrain.runs.skeleton`) and writes the run directory; the math is
in `algorithms/`, the steps in `losses/`, the held-out judgement in `evaluation/`. One module a
command (`online` serves grpo and ppo), its settings beside it (`*_config.py`); `stages`, `demo`,
`tool_demo` and `compare` chain recipes into a demo or a comparison."""
