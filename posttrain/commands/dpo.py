"""`posttrain dpo`: offline preference optimisation, DPO and its family (see posttrain/recipes/dpo.py)."""

from posttrain.commands._recipe import register_recipe


def register(subparsers) -> None:
    register_recipe(subparsers, "dpo", "posttrain.recipes.dpo", "DPO family: pairwise preference loss against a frozen reference",
                    config="posttrain.recipes.dpo_config:Config")
