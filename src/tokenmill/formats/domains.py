"""Topic-domain models (docs/formats.md, "Topic-domain models"): the card `model.json` that `tokenmill
domains train` writes beside the fine centroids (`clusters.npz`) and the document embedding
(`embedding.bin`, a fastText model).

The card is what a reader needs without loading the model: the sample it was fitted on, K and N, how
tight the domains are, and per domain its id (`c00`...), size, share, distinctive terms and example
documents. The overview page reads it; the curate stage reads it to find the model's files.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tokenmill.formats.base import Count, FormatModel, read_model, write_model

CARD = "model.json"
CLUSTERS = "clusters.npz"
EMBEDDING = "embedding.bin"
FORMAT_VERSION = 1


class DomainSample(FormatModel):
    """Which documents the model was fitted on."""

    inputs: list[str]
    documents_read: Count
    rejected: Count
    empty: Count
    requested: Count
    documents: Count
    seed: int
    method: str


class DomainEmbedding(FormatModel):
    """How a document becomes a vector: `trained` (fastText unsupervised on the sample, file
    `embedding.bin` in the model folder) or `external` (a fastText `.bin` the user named, by path)."""

    kind: Literal["trained", "external"]
    path: str
    sha256: str
    dim: Count
    max_chars: Count
    parameters: dict[str, int | float | str]


class DomainExample(FormatModel):
    id: str
    source: str
    cosine: float
    preview: str


class DomainEntry(FormatModel):
    id: str
    name: str
    terms: list[str]
    documents: Count
    share: float
    fine_clusters: Count
    cohesion: float  # mean cosine of the domain's documents to the domain's mean direction
    examples: list[DomainExample]


class FineClusters(FormatModel):
    k: Count
    iterations: Count
    converged: bool
    cohesion: float  # mean cosine of each document to its fine centroid


class DomainsCard(FormatModel):
    """model.json of a topic-domain model."""

    format_version: int
    kind: Literal["domains"]
    sample: DomainSample
    embedding: DomainEmbedding
    fine: FineClusters
    domains_requested: Count
    min_share: float = Field(ge=0, lt=1)
    within_domain_cosine: float
    between_domain_cosine: float
    domains: list[DomainEntry]
    clusters_sha256: str

    @model_validator(mode="after")
    def _domains_are_numbered(self) -> DomainsCard:
        ids = [domain.id for domain in self.domains]
        if ids != [domain_id(index, len(ids)) for index in range(len(ids))]:
            raise ValueError(f"domains: ids must be c00, c01, ... in order, got {ids}")
        return self


def domain_id(index: int, count: int) -> str:
    """`c00`..`c39`: two digits, or as many as the largest index needs, so that ids sort as numbers."""
    return f"c{index:0{max(2, len(str(max(count - 1, 0))))}d}"


def read_domains_card(path: str) -> DomainsCard:
    return read_model(DomainsCard, path)


def write_domains_card(path: str, card: DomainsCard) -> None:
    write_model(path, card)
