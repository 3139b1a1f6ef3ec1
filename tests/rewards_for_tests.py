"""Reward functions with signal on an untrained tiny model (importable by worker processes)."""


def digits(completion: str, example: dict) -> float:
    """1 if the completion contains a digit: random char-level samples split about evenly."""
    return float(any(character.isdigit() for character in completion))


def broken(completion: str, example: dict) -> float:
    raise RuntimeError("the reward service is down")


def constant(completion: str, example: dict) -> float:
    """The same reward for every row: every group's rewards are equal, the policy gradient is zero."""
    return 1.0


def zero(completion: str, example: dict) -> float:
    """0 for every row: no estimator gets a reward signal, whether or not it has groups."""
    return 0.0
