"""The shared transformer (dense and MoE) used by trainer and engine."""
