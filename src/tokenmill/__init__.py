"""tokenmill: raw text to a trained mixture-of-experts model.

Stages (each a subpackage; each imports only downward):
  pipelines  Apache Beam pipelines: curate, tokenize; runner options
  filters    heuristic filters (datatrove), language id, fastText classifiers
  tokenize   tokenizer training/loading, token shard writer/reader, counts catalog
  mixtures   mixture spec schema, planner, diff
  trainer    MoE model, router balancing, uniform sampler, train loop, checkpoints, FLOPs
  reports    data-overview page and run page
"""

__version__ = "0.1.0"
