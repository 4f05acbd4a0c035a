"""The JAX mixture-of-experts trainer, in five parts (docs/trainer.md, "Where things are"): model/ (the
network and what it counts), data/ (batches from token shards), run/ (a training run: configuration,
optimizer, step, loop, checkpoints), ladder/ (scaling ladders), commands/ (the command lines)."""
