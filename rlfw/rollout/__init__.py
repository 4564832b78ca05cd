"""Rollout: engines, sampling transforms and the four log-probability streams."""
