"""``rlfw audit``: the validation ladder on one checkpoint."""
