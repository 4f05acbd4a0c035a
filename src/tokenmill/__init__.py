"""tokenmill: raw text to a trained mixture-of-experts model.

Stages (each a subpackage), connected by files whose formats docs/formats.md fixes:
  corpora    reading raw input (JSON Lines, Parquet, WARC) into documents and rejected records, no Beam
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
  2. `corpora`, the readers of raw input that curate, the domain classifier's training and evaluation
     sets share: it imports only the bottom, and never Apache Beam.
  3. The stages that make files: pipelines, filters, tokenize, mixtures, domains. They import the bottom,
     corpora and one another, in no cycle (curate runs filters; the pipelines run tokenize's writer and
     the domain clusters), never what is above.
  4. trainer and reports read the files below through `formats` (and the token shards through
     tokenize.shards), and never import Apache Beam, however indirectly: training and the page need no
     pipeline runner. `samples` (the sample corpus, classifier data and report inputs made from scratch)
     sits beside them and imports only the bottom.
  5. cli.py on top: it collects every stage's `register` and is imported by nothing but __main__.
The package's own data (configs/classifiers, templates) ships inside it and is found with
importlib.resources, never by walking up from a source file to a checkout.
"""

__version__ = "0.1.0"
