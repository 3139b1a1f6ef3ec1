"""posttrain: post-training for language models.

Four separate links make every run (docs/architecture.md): where the data comes from (`posttrain.data`,
`posttrain.rollout`), who gives the reward (`posttrain.rewards`), how the loss is computed
(`posttrain.algorithms`, `posttrain.recipes`) and who accepts the result (`posttrain.evaluation`).
"""

__version__ = "0.1.0"
