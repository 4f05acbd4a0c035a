"""A fitted topic-domain model: embed a document, find its nearest fine centroid, name that centroid's domain.

A model folder holds `model.json` (the card, tokenmill.formats.domains), `clusters.npz` (the fine
centroids, the fine cluster -> domain map and the centring vector) and, when the embedding was trained on
the sample, `embedding.bin` (fastText). Predicting is the same arithmetic the fit used, so a document of
the sample is placed where the fit placed it.

A document's vector: its text lower-cased and split into words and punctuation marks (the first
`max_chars` characters), fastText's sentence vector of that (the mean of the unit word vectors, sub-words
included, so unseen words still count), minus the sample's mean vector (without the centring every
English text points the same way, along the vectors of "the", "of", "and"), scaled to unit length.

Memory: the fastText model (dim x (vocabulary + buckets) floats: 48 x 200,000 x 4 bytes = 38 MB for the
trained default) and K x dim centroids (5,000 x 48 x 4 = 1 MB), once per process.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.domains.clustering import nearest, normalize_rows
from tokenmill.errors import FormatError
from tokenmill.formats.domains import CARD, CLUSTERS, DomainsCard, read_domains_card

_TOKEN = re.compile(r"\w+|[^\w\s]")
#: The arrays of clusters.npz.
CLUSTER_ARRAYS = ("centroids", "fine_to_domain", "center")


class DomainsError(ValueError):
    """A topic-domain model that cannot be fitted or used; the message names the file or the option."""


def embedding_line(text: str, max_chars: int) -> str:
    """The line fastText sees for a document: lower-cased words and punctuation marks, space-separated
    (punctuation is kept as tokens: `(`, `:` and `=` tell code from prose)."""
    return " ".join(_TOKEN.findall(text[:max_chars].lower()))


def sentence_vectors(embedding: Any, texts: Sequence[str], max_chars: int) -> np.ndarray:
    """fastText sentence vectors (n x dim float32) of the texts' embedding lines."""
    vectors = np.zeros((len(texts), embedding.get_dimension()), dtype=np.float32)
    for row, text in enumerate(texts):
        line = embedding_line(text, max_chars)
        if line:
            vectors[row] = embedding.get_sentence_vector(line)
    return vectors


def document_vectors(raw: np.ndarray, center: np.ndarray) -> np.ndarray:
    """Centred, unit-length document vectors from sentence vectors."""
    return normalize_rows((raw - center).astype(np.float32))


def write_clusters(path: str, centroids: np.ndarray, fine_to_domain: np.ndarray, center: np.ndarray) -> None:
    """clusters.npz, atomically and with the same bytes for the same arrays (zip entries carry a fixed date,
    unlike numpy.savez's)."""
    buffer = io.BytesIO()
    arrays = {
        "centroids": np.ascontiguousarray(centroids, dtype=np.float32),
        "fine_to_domain": np.ascontiguousarray(fine_to_domain, dtype=np.int32),
        "center": np.ascontiguousarray(center, dtype=np.float32),
    }
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w") as handle:
                np.lib.format.write_array(handle, array, allow_pickle=False)
    storage.write_bytes(path, buffer.getvalue())


@dataclass
class DomainModel:
    """A loaded model: `assign(texts)` gives each text's domain id and its cosine to the fine centroid."""

    card: DomainsCard
    embedding: Any  # a fastText model
    centroids: np.ndarray  # K x dim, unit rows
    fine_to_domain: np.ndarray  # K, domain index
    center: np.ndarray  # dim
    path: str = ""

    @property
    def domain_ids(self) -> list[str]:
        return [domain.id for domain in self.card.domains]

    @property
    def max_chars(self) -> int:
        return self.card.embedding.max_chars

    def vectors(self, texts: Sequence[str]) -> np.ndarray:
        return document_vectors(sentence_vectors(self.embedding, texts, self.max_chars), self.center)

    def assign_vectors(self, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(domain index, fine cluster, cosine to the fine centroid) per row of unit vectors."""
        fine, similarity = nearest(vectors, self.centroids)
        return self.fine_to_domain[fine], fine, similarity

    def assign(self, texts: Sequence[str]) -> tuple[list[str], np.ndarray]:
        """Each text's domain id (`c00`...) and its cosine to its nearest fine centroid."""
        if not texts:
            return [], np.zeros(0, dtype=np.float32)
        domains, _, similarity = self.assign_vectors(self.vectors(texts))
        ids = self.domain_ids
        return [ids[index] for index in domains.tolist()], similarity


def embedding_path(model_dir: str, card: DomainsCard) -> str:
    """Where the card's embedding is: inside the model folder when trained, else the path the user gave."""
    return (
        storage.join(model_dir, card.embedding.path)
        if card.embedding.kind == "trained"
        else card.embedding.path
    )


def load_fasttext_embedding(path: str) -> Any:
    """A fastText model from a local or gs:// path (downloaded once per machine), errors naming the file."""
    from tokenmill.filters.classifiers import ClassifierError, load_fasttext

    try:
        return load_fasttext(path)
    except ClassifierError as error:
        raise DomainsError(str(error)) from None


def load_domain_model(path: str) -> DomainModel:
    """The model in the folder `path` (local or gs://); DomainsError names what is missing or broken."""
    path = path.rstrip("/")
    card_path = storage.join(path, CARD)
    if not storage.exists(card_path):
        raise DomainsError(
            f"topic-domain model not found: no {card_path} (train one with `tokenmill domains train`)"
        )
    try:
        card = read_domains_card(card_path)
    except FormatError as error:
        raise DomainsError(f"not a topic-domain model card: {error}") from None
    clusters_path = storage.join(path, CLUSTERS)
    try:
        with storage.open_file(clusters_path, "rb") as handle, np.load(io.BytesIO(handle.read())) as arrays:
            centroids, fine_to_domain, center = (arrays[name] for name in CLUSTER_ARRAYS)
    except FileNotFoundError:
        raise DomainsError(f"{clusters_path}: missing (the model folder is incomplete)") from None
    except (KeyError, ValueError, OSError, zipfile.BadZipFile) as error:
        raise DomainsError(f"{clusters_path}: not a clusters file ({error})") from None
    embedding = load_fasttext_embedding(embedding_path(path, card))
    dim = embedding.get_dimension()
    problems = []
    if centroids.ndim != 2 or centroids.shape != (card.fine.k, dim):
        problems.append(
            f"centroids are {centroids.shape}, the card says K={card.fine.k} and the embedding dim={dim}"
        )
    if fine_to_domain.shape != (card.fine.k,) or not (
        len(fine_to_domain) and 0 <= fine_to_domain.min() and fine_to_domain.max() < len(card.domains)
    ):
        problems.append(f"fine_to_domain does not map {card.fine.k} clusters to {len(card.domains)} domains")
    if center.shape != (dim,):
        problems.append(f"center is {center.shape}, the embedding dim is {dim}")
    if problems:
        raise DomainsError(f"{clusters_path}: " + "; ".join(problems))
    return DomainModel(
        card, embedding, centroids.astype(np.float32), fine_to_domain.astype(np.int64), center, path
    )
