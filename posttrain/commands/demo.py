"""`posttrain demo`: SFT, then GRPO and DPO from the same start, held-out acceptance, a report."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "demo", "posttrain.recipes.demo",
                    "the main job: SFT -> GRPO vs pairs+DPO on the tiny model, with held-out acceptance and a report")
