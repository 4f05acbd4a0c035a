"""Make the bundled classifiers' labelled data: `python scripts/make_classifier_data.py --output DIR`.

A thin wrapper: `tokenmill.samples.classifier_data` does the work (also `python -m
tokenmill.samples.classifier_data`), and its docstring writes down the labelling rules.
"""

import sys

from tokenmill.samples.classifier_data import main

if __name__ == "__main__":
    sys.exit(main())
