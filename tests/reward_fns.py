"""A custom reward function that fails, for the reward-failure test."""


def explodes(response: str, answer: str) -> float:
    raise RuntimeError("judge crashed")
