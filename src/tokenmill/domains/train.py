"""`tokenmill domains train`: topic domains found in the corpus itself, needing no labels.

    sample S documents -> embed (fastText unsupervised, trained on the sample, or a given .bin)
        -> spherical k-means, K fine clusters -> Ward coarsening to N domains of at least `min_share`
        -> names (distinctive terms), examples, model card

The fit runs in one process on a sample. The sample is the S documents whose ids hash lowest (seeded
64-bit BLAKE2b), a bottom-S sample: uniform, the same whatever the order or sharding of the input, found in
one streaming pass with a heap of S entries. Every document read is counted: sampled, not sampled, empty
or rejected (bad input lines, as curate rejects them).

Memory grows with the sample, not the corpus: the sampled texts (S x mean document size: 100,000 web
documents are about 400 MB), their vectors (S x dim x 4 bytes), one chunk of K similarities at a time
and, for the names, each sampled document's set of terms. fastText trains with one thread, so the same
sample and seed give the same bytes; its time grows with the sample's words x epochs. For Marin's scale (a
10M-document sample, K = 5,000) one would embed in Beam (the model is a per-worker `SharedModel`, as the
curate stage uses it) into vector shards, fit k-means on a machine with ~4 GB for the 10M x 64 float32
vectors (or by mini-batches), and count the naming terms with a Beam combiner; the coarsening already
works on the K centroids alone. docs/curate.md says the same.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import os
import random
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tokenmill import storage
from tokenmill.corpora.paths import input_root
from tokenmill.corpora.readers import input_format, read_file
from tokenmill.corpora.records import InputFields
from tokenmill.domains.clustering import coarsen, normalize_rows, spherical_kmeans
from tokenmill.domains.model import (
    DomainsError,
    document_vectors,
    embedding_line,
    load_fasttext_embedding,
    sentence_vectors,
    write_clusters,
)
from tokenmill.filters.normalize import normalize_text
from tokenmill.formats.domains import (
    CARD,
    CLUSTERS,
    EMBEDDING,
    FORMAT_VERSION,
    DomainEmbedding,
    DomainEntry,
    DomainExample,
    DomainSample,
    DomainsCard,
    FineClusters,
    domain_id,
    write_domains_card,
)

log = logging.getLogger(__name__)

#: Terms for names: a letter, then letters, digits or underscores (identifiers count; numbers do not).
_TERM = re.compile(r"[^\W\d_]\w+")
PREVIEW_CHARS = 300


EPOCH_TOKENS = 1_000_000
EPOCH_RANGE = (5, 50)
#: A word-vector training that diverges (NaN) is run again at half the learning rate, this many times;
#: the card records the lr that trained the vectors.
DIVERGED_RETRIES = 3


@dataclass(frozen=True)
class FastTextSettings:
    """fastText unsupervised hyperparameters (fastText's names), sized so that a sample of a few thousand
    documents trains in seconds; sub-words (minn..maxn) place words the sample never saw."""

    model: str = "cbow"
    dim: int = 48
    #: None: enough passes that fastText sees about EPOCH_TOKENS tokens (5 to 50 passes). A small sample
    #: needs many passes for its word vectors to mean anything; a large one needs few.
    epoch: int | None = None
    minCount: int = 2  # noqa: N815 - fastText's name
    minn: int = 3
    maxn: int = 5
    bucket: int = 200_000
    lr: float = 0.05


@dataclass(frozen=True)
class DomainSettings:
    k: int
    domains: int
    sample: int = 100_000
    min_share: float = 0.01
    seed: int = 0
    #: "fasttext" trains one on the sample; anything else is the path of a fastText .bin to use as is.
    embedding: str = "fasttext"
    max_chars: int = 8000
    terms: int = 8
    examples: int = 3
    fasttext: FastTextSettings = FastTextSettings()
    fields: InputFields = InputFields()

    def check(self) -> None:
        if self.k < 1 or self.domains < 1:
            raise DomainsError(f"--k and --domains must be at least 1 (got K={self.k}, N={self.domains})")
        if self.k < self.domains:
            raise DomainsError(
                f"--k {self.k} is less than --domains {self.domains}: "
                "domains are merged fine clusters, so K >= N"
            )
        if not 0 <= self.min_share < 1:
            raise DomainsError(f"--min-share must be in [0, 1), got {self.min_share}")
        if self.min_share * self.domains > 1:
            raise DomainsError(
                f"--min-share {self.min_share} x --domains {self.domains} is more than every document"
            )
        if self.sample < 1:
            raise DomainsError(f"--sample must be at least 1, got {self.sample}")


@dataclass
class SampledDocument:
    id: str
    source: str
    text: str


def input_files(patterns: list[str]) -> list[str]:
    """The files of each --input: a folder gives every file below it in a format curate reads; a path or
    glob gives its matches. A pattern that names nothing readable is an error."""
    files: list[str] = []
    for pattern in patterns:
        local_folder = storage.is_local(pattern) and os.path.isdir(storage.local_path(pattern))
        if local_folder or (
            not storage.is_local(pattern)
            and not set("*?[") & set(pattern)
            and storage.is_dir_nonempty(pattern)
        ):
            found = [path for path in storage.list_files(pattern) if input_format(path) is not None]
            found = [
                path for path in found if not os.path.basename(path).startswith(storage.TEMPORARY_PREFIX)
            ]
        else:
            found = storage.expand_glob(pattern)
        if not found:
            raise DomainsError(
                f"--input {pattern!r}: no input files (.jsonl[.gz|.zst], .parquet, .warc[.gz])"
            )
        files.extend(found)
    return sorted(dict.fromkeys(files))


def _root_pattern(pattern: str) -> str:
    """A folder names its own contents, so that sources are relative to it (as `DIR/*` would give)."""
    if storage.is_local(pattern) and os.path.isdir(storage.local_path(pattern)):
        return pattern.rstrip("/") + "/"
    return pattern


def sample_key(seed: int, document_id: str) -> int:
    """The document's place in the bottom-S order: the same 64-bit BLAKE2b as
    tokenmill.pipelines.sinks.stable_hash, here because that module imports Beam (seconds of start-up that
    a fit outside Beam does not need)."""
    digest = hashlib.blake2b(f"{seed}:{document_id}".encode("utf-8", "surrogatepass"), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def sample_documents(
    files: list[str], root: str, settings: DomainSettings
) -> tuple[list[SampledDocument], dict[str, int]]:
    """The bottom-S sample by seeded id hash, in hash order, and the counts of what was read."""
    counts = {"documents_read": 0, "rejected": 0, "empty": 0}
    heap: list[tuple[int, str, str, str]] = []  # (-hash, id, source, text): the root is the largest hash kept
    for path in files:
        for record in read_file(path, settings.fields, root):
            counts["documents_read"] += 1
            if record.get("kind") == "rejected":
                counts["rejected"] += 1
                continue
            text = normalize_text(record["text"])
            if not text.strip():
                counts["empty"] += 1
                continue
            key = -sample_key(settings.seed, record["id"])
            entry = (key, record["id"], record["source"], text)
            if len(heap) < settings.sample:
                heapq.heappush(heap, entry)
            elif entry > heap[0]:
                heapq.heapreplace(heap, entry)
    ordered = sorted(heap, reverse=True)  # lowest hash first
    return [SampledDocument(id_, source, text) for _, id_, source, text in ordered], counts


def _train_fasttext(documents: list[SampledDocument], settings: DomainSettings, workdir: str):
    import fasttext

    order = list(range(len(documents)))
    random.Random(settings.seed).shuffle(order)  # fastText's own seed is fixed; the line order is ours
    corpus = os.path.join(workdir, "sample.txt")
    tokens = 0
    with open(corpus, "w", encoding="utf-8") as handle:
        for index in order:
            line = embedding_line(documents[index].text, settings.max_chars)
            if line:
                handle.write(line + "\n")
                tokens += line.count(" ") + 1
    parameters = dict(vars(settings.fasttext))
    if parameters["epoch"] is None:
        parameters["epoch"] = min(
            max(math.ceil(EPOCH_TOKENS / max(tokens, 1)), EPOCH_RANGE[0]), EPOCH_RANGE[1]
        )
    for attempt in range(DIVERGED_RETRIES + 1):
        try:
            return fasttext.train_unsupervised(corpus, thread=1, verbose=0, **parameters), parameters
        except RuntimeError as error:
            # fastText's only remedy for a diverged run is a lower learning rate (its authors' advice); a
            # run is deterministic, so the same lr would diverge again.
            if "NaN" not in str(error) or attempt == DIVERGED_RETRIES:
                raise DomainsError(
                    f"fastText could not train word vectors on the sample at lr {parameters['lr']:g} "
                    f"({error}); a larger --sample or another --embedding helps"
                ) from None
            log.warning(
                "domains: fastText diverged (NaN) at lr %g on the sample; training again at lr %g",
                parameters["lr"],
                parameters["lr"] / 2,
            )
            parameters["lr"] /= 2


def distinctive_terms(
    documents: list[SampledDocument], domain_of: np.ndarray, domains: int, count: int, max_chars: int
) -> list[list[str]]:
    """Per domain, the terms that most set it apart: p_d(t) * log(p_d(t) / p(t)) * log(1 / p(t)), with p_d
    and p the shares of documents holding the term in the domain and in the whole sample: how much the
    term says about the domain (its share of the domain's divergence from the sample) times its idf, which
    keeps words every text uses ("the", "that") out of names. A term needs two documents of the domain."""
    overall: Counter[str] = Counter()
    within = [Counter() for _ in range(domains)]
    for document, domain in zip(documents, domain_of.tolist()):
        terms = set(_TERM.findall(document.text[:max_chars].lower()))
        overall.update(terms)
        within[domain].update(terms)
    sizes = np.bincount(domain_of, minlength=domains)
    total = len(documents)
    names = []
    for domain in range(domains):
        size = int(sizes[domain])
        scored = []
        for term, hits in within[domain].items():
            if hits < min(2, size):
                continue
            inside, everywhere = hits / size, overall[term] / total
            if inside > everywhere:
                scored.append((-inside * math.log(inside / everywhere) * math.log(1 / everywhere), term))
        names.append([term for _, term in sorted(scored)[:count]])
    return names


def _preview(text: str) -> str:
    return text[:PREVIEW_CHARS].rstrip()


def _copy_to(local: str, target: str) -> None:
    with open(local, "rb") as source, storage.atomic_write(target, "wb") as handle:
        shutil.copyfileobj(source, handle, 1 << 20)


def train_domains(patterns: list[str], output: str, settings: DomainSettings) -> DomainsCard:
    """Fit a topic-domain model on a sample of `patterns` and write it to `output` (model.json last, so
    a folder with a card holds a whole model)."""
    settings.check()
    files = input_files(patterns)
    root = input_root([_root_pattern(pattern) for pattern in patterns])
    documents, counts = sample_documents(files, root, settings)
    if not documents:
        raise DomainsError(
            f"--input {' '.join(patterns)}: no documents with text ({counts['documents_read']} records read, "
            f"{counts['rejected']} rejected, {counts['empty']} empty)"
        )
    if len(documents) < settings.k:
        raise DomainsError(
            f"--k {settings.k} fine clusters need at least {settings.k} documents; "
            f"the sample has {len(documents)}"
        )
    log.debug("domains: %d documents sampled of %d read", len(documents), counts["documents_read"])

    storage.make_dirs(output)
    storage.remove_file(storage.join(output, CARD))  # the old card goes first: no card, no finished model
    texts = [document.text for document in documents]
    with tempfile.TemporaryDirectory(prefix="tokenmill-domains-") as workdir:
        if settings.embedding == "fasttext":
            embedding, parameters = _train_fasttext(documents, settings, workdir)
            local = os.path.join(workdir, EMBEDDING)
            embedding.save_model(local)
            _copy_to(local, storage.join(output, EMBEDDING))
            embedding_card = DomainEmbedding(
                kind="trained",
                path=EMBEDDING,
                sha256=storage.file_sha256(local),
                dim=embedding.get_dimension(),
                max_chars=settings.max_chars,
                parameters={**parameters, "thread": 1},
            )
        else:
            embedding = load_fasttext_embedding(settings.embedding)
            embedding_card = DomainEmbedding(
                kind="external",
                path=settings.embedding,
                sha256=storage.file_sha256(settings.embedding),
                dim=embedding.get_dimension(),
                max_chars=settings.max_chars,
                parameters={},
            )
    raw = sentence_vectors(embedding, texts, settings.max_chars)
    center = raw.mean(axis=0).astype(np.float32)
    vectors = document_vectors(raw, center)

    fine = spherical_kmeans(vectors, settings.k, seed=settings.seed)
    sums = np.zeros((settings.k, vectors.shape[1]), dtype=np.float64)
    np.add.at(sums, fine.labels, vectors)
    sizes = np.bincount(fine.labels, minlength=settings.k)
    fine_to_domain = coarsen(sums, sizes, settings.domains, settings.min_share)
    domain_of = fine_to_domain[fine.labels]
    count = int(fine_to_domain.max()) + 1

    directions = normalize_rows(np.stack([vectors[domain_of == d].sum(axis=0) for d in range(count)]))
    to_own_domain = np.einsum("ij,ij->i", vectors, directions[domain_of])
    terms = distinctive_terms(documents, domain_of, count, settings.terms, settings.max_chars)
    between = directions @ directions.T
    entries = []
    for domain in range(count):
        members = np.flatnonzero(domain_of == domain)
        best = members[np.argsort(-to_own_domain[members], kind="stable")[: settings.examples]]
        entries.append(
            DomainEntry(
                id=domain_id(domain, count),
                name=" ".join(terms[domain][:3]) or domain_id(domain, count),
                terms=terms[domain],
                documents=len(members),
                share=round(len(members) / len(documents), 6),
                fine_clusters=int((fine_to_domain == domain).sum()),
                cohesion=round(float(to_own_domain[members].mean()), 6),
                examples=[
                    DomainExample(
                        id=documents[row].id,
                        source=documents[row].source,
                        cosine=round(float(to_own_domain[row]), 6),
                        preview=_preview(documents[row].text),
                    )
                    for row in best.tolist()
                ],
            )
        )
    clusters_path = storage.join(output, CLUSTERS)
    write_clusters(clusters_path, fine.centroids, fine_to_domain, center)
    card = DomainsCard(
        format_version=FORMAT_VERSION,
        kind="domains",
        sample=DomainSample(
            inputs=list(patterns),
            requested=settings.sample,
            documents=len(documents),
            seed=settings.seed,
            method="bottom-S by blake2b-64(seed:id)",
            **counts,
        ),
        embedding=embedding_card,
        fine=FineClusters(
            k=settings.k,
            iterations=fine.iterations,
            converged=fine.converged,
            cohesion=round(float(fine.similarity.mean()), 6),
        ),
        domains_requested=settings.domains,
        min_share=settings.min_share,
        within_domain_cosine=round(float(to_own_domain.mean()), 6),
        between_domain_cosine=round(
            float((between.sum() - count) / (count * (count - 1))) if count > 1 else 1.0, 6
        ),
        domains=entries,
        clusters_sha256=storage.file_sha256(clusters_path),
    )
    write_domains_card(storage.join(output, CARD), card)
    return card


def iter_domain_lines(card: DomainsCard) -> Iterator[str]:
    """The card as a table for the terminal."""
    yield f"  {'domain':<6} {'docs':>7} {'share':>7} {'cohesion':>8}  terms"
    for domain in card.domains:
        yield (
            f"  {domain.id:<6} {domain.documents:>7,} {domain.share:>7.1%} {domain.cohesion:>8.3f}  "
            + ", ".join(domain.terms)
        )
