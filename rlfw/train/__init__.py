"""The driver: set-up, the synchronous and asynchronous step loops, their shared phases, the step report,
the run state and checkpoints. ``rlfw train`` calls :func:`rlfw.train.run.train`."""
