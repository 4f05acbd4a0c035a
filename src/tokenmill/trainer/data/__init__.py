"""The trainer's data: the batch contract, and the uniform sampler over token shards (keyed permutations,
windows, local direct I/O, ranged reads from object storage). Never imports the model or the run."""
