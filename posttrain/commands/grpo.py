"""`posttrain grpo`: GRPO with any verifier as the reward (see posttrain/recipes/grpo.py)."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "grpo", "posttrain.recipes.grpo", "GRPO: group-relative advantages, clipped surrogate, no critic")
