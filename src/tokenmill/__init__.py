"""tokenmill: raw text to a trained mixture-of-experts model.

Stages (each a subpackage), connected by files whose formats docs/formats.md fixes:
  pipelines  Apache Beam pipelines: curate, tokenize; runner options
  filters    heuristic filters (datatrove), language id, fastText classifiers, decontamination
  tokenize   tokenizer training/loading, token shard writer/reader, counts catalog
  mixtures   mixture spec schema, planner, diff
  trainer    MoE model, router balancing, uniform sampler, train loop, checkpoints, FLOPs, scaling ladder
  reports    data-overview page and run page

Imports run downward only (tests/test_package_layout.py checks it):
  1. At the bottom, importing nothing above them: `errors` (the errors commands share), `storage` (local
     paths and gs://), `units`, `cells`, `validation`, and `formats`, the one typed reader and writer of
     each file that connects the stages. Any module may import these.
  2. The stages that make files: pipelines, filters, tokenize, mixtures. They import the bottom and one
     another (curate runs filters; tokenize's command runs its Beam pipeline), never what is above.
  3. trainer and reports read the files below through `formats` (and the token shards through
     tokenize.shards), and never import Apache Beam, however indirectly: training and the page need no
     pipeline runner. `samples` (the sample corpus, classifier data and report inputs made from scratch)
     sits beside them and imports only the bottom.
  4. cli.py on top: it collects every stage's `register` and is imported by nothing but __main__.
The package's own data (configs/classifiers, templates) ships inside it and is found with
importlib.resources, never by walking up from a source file to a checkout.
"""

__version__ = "0.1.0"
