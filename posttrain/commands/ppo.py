"""`posttrain ppo`: PPO with a learned critic and any verifier as the reward (posttrain/recipes/ppo.py)."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "ppo", "posttrain.recipes.ppo", "PPO with a learned critic: GAE, clipped surrogate, clipped value loss")
