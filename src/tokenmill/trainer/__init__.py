"""The JAX mixture-of-experts trainer: model, router balancing, sampler, train loop, checkpoints, FLOPs."""
