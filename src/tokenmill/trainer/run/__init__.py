"""A training run: its configuration resolved once, the optimizer, the step (built, and compiled ahead of
time), the loop, checkpoints and resume, metrics, telemetry, live publishing, multi-host setup."""
