"""Apache Beam pipelines (curate, tokenize) and the runner options they share."""
