"""The curate stage `domain_clusters: {model: DIR}`: every document's `domain` becomes its topic domain.

The stage sets `domain` (`c00`...) and `domain_score` (the cosine to the nearest fine centroid), so the
cells are cNN x quality. It replaces a domain classifier's label: stages that read that label (`by_domain`
chains, `domain_classifier` itself) come before it, which the recipe checks. The quality classifier may
come before it (its cuts are then per content type, the classifier's label) or after it (the cuts of `*`,
or per cNN if its calibration names them).

The model is loaded once per worker process through a `SharedModel` (tokenmill.filters.models), as the
classifier stages load theirs, and at recipe load, so that a missing or broken model fails before the
pipeline starts. At 10 TB on 1,000 workers: memory is one model per worker process whatever the data
(the fastText vectors, ~40 MB as trained by default or a few GB for Common Crawl vectors, and K x dim
centroids: 5,000 x 48 floats are 1 MB) plus the batch; CPU is one sentence vector over the first
`max_chars` characters and one K x dim product per document, so it grows linearly with the documents and
not with their length; no shuffle.
"""

from __future__ import annotations

from tokenmill.domains.model import DomainModel, load_domain_model
from tokenmill.filters.base import Removal
from tokenmill.filters.models import SharedModel, SharedModelStep


class DomainClusters(SharedModelStep):
    stage = "domain_clusters"

    def __init__(self, model: str):
        self.model_path = model
        self._shared_model = SharedModel(load_domain_model, model)
        self._model: DomainModel | None = None
        self.domain_ids = self._shared_model.get().domain_ids  # fail now, before any pipeline starts

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._model is None:
            self.setup()
        ids, scores = self._model.assign([document["text"] for document in documents])
        for document, domain, score in zip(documents, ids, scores.tolist()):
            document["domain"] = domain
            document["domain_score"] = score
        return [None] * len(documents)
