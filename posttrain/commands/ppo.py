"""`posttrain ppo`: PPO with a learned critic and any verifier as the reward (posttrain/recipes/online.py,
`loss.advantage: gae`)."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "ppo", "posttrain.recipes.online", "PPO with a learned critic: GAE, clipped surrogate, clipped value loss",
                    config="posttrain.recipes.online_config:ppo_config")
