"""Per-document checks: normalization, language id, datatrove heuristic filters, classifiers."""
