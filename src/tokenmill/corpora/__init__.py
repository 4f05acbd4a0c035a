"""Reading raw input without Beam: JSON Lines, Parquet and WARC files in, documents and rejected records out.

`readers.read_file` reads one input file whatever its format (`warc` for web crawls); `records` makes the
documents and rejected records every reader gives; `paths` names the files an input pattern matches and
the `source` each is called by. Curate's pipeline, the domain classifier's training and evaluation sets
all read their input through here.
"""
