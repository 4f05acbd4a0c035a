"""Make the bundled sample corpus: `python scripts/make_sample_corpus.py --output data/sample`.

A thin wrapper: `tokenmill.samples.corpus` does the work (also `python -m tokenmill.samples.corpus`).
"""

import sys

from tokenmill.samples.corpus import main

if __name__ == "__main__":
    sys.exit(main())
