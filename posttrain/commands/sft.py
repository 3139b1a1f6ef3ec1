"""`posttrain sft`: supervised fine-tuning (see posttrain/recipes/sft.py)."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "sft", "posttrain.recipes.sft", "supervised fine-tuning: masked NLL on response tokens")
