"""rlfw: RL post-training for LLMs that measures, names and corrects the training-inference mismatch."""

__version__ = "0.1.0"
