"""The DeepSpeed trainer: scoring forward, loss, optimizer step, weight publishing."""
