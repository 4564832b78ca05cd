"""The reward of the bring-your-own-task example: 1 for the exact double, partial credit for a number
that is close. rlfw calls it as reward(prompt=..., response=..., **row); it declares only the fields it
reads (`response` and the row's `n`), so the others are not passed."""


def reward(response: str, n: int) -> float:
    try:
        value = int(response.strip())
    except ValueError:
        return 0.0
    return 1.0 if value == 2 * n else max(0.0, 0.5 - abs(value - 2 * n) / 20)
