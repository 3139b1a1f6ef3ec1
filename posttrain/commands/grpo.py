"""`posttrain grpo`: GRPO with any verifier as the reward (see posttrain/recipes/online.py)."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "grpo", "posttrain.recipes.online", "GRPO: group-relative advantages, clipped surrogate, no critic",
                    config="posttrain.recipes.online_config:grpo_config")
