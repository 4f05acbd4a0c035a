"""Data made from scratch for the demo, the tests and the benchmarks: nothing is downloaded.

  text             text generators: prose and code from the Python install, other languages, spam,
                   boilerplate, near duplicates
  corpus           the bundled sample corpus, data/sample/ (`python -m tokenmill.samples.corpus`)
  classifier_data  labelled data for the bundled classifiers (`python -m tokenmill.samples.classifier_data`)
  report_inputs    a complete set of the report's inputs, from a handful of cells to the benchmark's 200

The same Python version and seed give the same bytes. These modules sit beside the stages: they import
only the formats' schemas, never a stage, so that scripts/, bench/ and tests/ import them as they import
any other part of the package.
"""
