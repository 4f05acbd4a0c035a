"""Tokenizers: load any Hugging Face tokenizer.json, train a byte-level BPE, and describe it for manifests.

A tokenizer is named in token manifests by the sha256 of its tokenizer.json bytes, so that shards made with
one tokenizer are never read with another. Loading sets the tokenizer up the way the shard writer needs it:
no special tokens added around a document (no BOS; the writer appends end-of-text itself), and special-token
text inside a document (a web page quoting `<|endoftext|>`) is encoded as ordinary text, so the only
end-of-text ids in a shard are the document boundaries the writer put there.

The project never downloads a tokenizer: it takes a path, or trains one with `tokenmill tokenizer train`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

from tokenmill import storage

log = logging.getLogger(__name__)

# Tried in order when the caller names no end-of-text token: GPT-2/tokenmill, Llama-3, SentencePiece styles.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
TRAINED_EOS = "<|endoftext|>"
UINT16_MAX_VOCAB = 65536

# The Llama-3 / GPT-4 pre-tokenization pattern: words with their leading space or punctuation, numbers in
# groups of at most three digits, runs of punctuation, newlines. Used with behavior="isolated", it keeps
# every character, so decoding gives back the exact text.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used: missing, unreadable, or without an end-of-text token."""


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    """What a token manifest records about the tokenizer, and what the writer needs to know."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str

    @property
    def dtype(self) -> str:
        return dtype_for_vocab(self.vocab_size)

    def manifest_entry(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size}


def dtype_for_vocab(vocab_size: int) -> str:
    """`uint16` when every id fits (vocabulary of at most 65,536), else `uint32`."""
    if vocab_size <= 0:
        raise ValueError(f"vocabulary size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def meta_path(tokenizer_path: str) -> str:
    """The sidecar beside a trained tokenizer: `tokenizer.json` -> `tokenizer.meta.json`."""
    base = tokenizer_path[: -len(".json")] if tokenizer_path.endswith(".json") else tokenizer_path
    return base + ".meta.json"


def default_name(tokenizer_path: str, sha256: str) -> str:
    """A name for a tokenizer with no recorded one: the sidecar's, else the file or folder name."""
    sidecar = meta_path(tokenizer_path)
    if storage.exists(sidecar):
        try:
            meta = storage.read_json(sidecar)
        except (OSError, ValueError):
            meta = {}
        # A sidecar left beside a tokenizer.json that was since replaced must not lend it its name.
        if meta.get("sha256") == sha256 and meta.get("name"):
            return str(meta["name"])
        log.warning("ignoring %s: it describes a different tokenizer.json", sidecar)
    stem = os.path.basename(tokenizer_path.rstrip("/"))
    stem = stem[: -len(".json")] if stem.endswith(".json") else stem
    if stem == "tokenizer":
        # Hub-style folders (`Llama-3.1-8B/tokenizer.json`) are named by the folder.
        parent = os.path.basename(os.path.dirname(tokenizer_path.rstrip("/")))
        return parent or stem
    return stem


def trained_name(vocab_size: int) -> str:
    return f"tokenmill-bpe-{vocab_size // 1024}k" if vocab_size % 1024 == 0 else f"tokenmill-bpe-{vocab_size}"


def tokenizer_from_bytes(data: bytes, source: str = "tokenizer.json"):
    """A `tokenizers.Tokenizer` from tokenizer.json bytes, set up for writing shards."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"{source}: not a Hugging Face tokenizer.json ({error})") from error
    # Special-token text inside a document is encoded as text: only the writer's separators are end-of-text.
    tokenizer.encode_special_tokens = True
    return tokenizer


def describe(
    tokenizer, data: bytes, path: str, name: str | None = None, eos_token: str | None = None
) -> TokenizerInfo:
    """The manifest description of a loaded tokenizer; raises TokenizerError without an end-of-text token."""
    if eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(f"{path}: has no token {eos_token!r} (given as the end-of-text token)")
    else:
        for candidate in EOS_CANDIDATES:
            eos_id = tokenizer.token_to_id(candidate)
            if eos_id is not None:
                eos_token = candidate
                break
        else:
            raise TokenizerError(
                f"{path}: no end-of-text token found (looked for {', '.join(EOS_CANDIDATES)}); "
                "name it with --eos-token"
            )
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    # Ids may be sparse; the dtype must hold the largest one.
    vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    sha256 = sha256_bytes(data)
    return TokenizerInfo(
        name=name or default_name(path, sha256),
        sha256=sha256,
        vocab_size=int(vocab_size),
        eos_id=int(eos_id),
        eos_token=str(eos_token),
    )


def read_tokenizer_bytes(path: str) -> bytes:
    if not storage.exists(path):
        raise TokenizerError(f"tokenizer file not found: {path}")
    with storage.open_file(path, "rb") as handle:
        return handle.read()


def load_tokenizer(path: str, name: str | None = None, eos_token: str | None = None):
    """Load a tokenizer.json: returns (tokenizers.Tokenizer, TokenizerInfo)."""
    data = read_tokenizer_bytes(path)
    tokenizer = tokenizer_from_bytes(data, path)
    return tokenizer, describe(tokenizer, data, path, name=name, eos_token=eos_token)


def new_byte_level_bpe():
    """An untrained byte-level BPE: Llama-3 style splitting, no normalizer, so decoding is exact."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    # No normalizer: curated text is already NFC, and any normalization here would break the round trip.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_byte_level_bpe(
    texts: Iterable[list[str]], vocab_size: int, min_frequency: int = 2, length: int | None = None
):
    """Train a byte-level BPE with `<|endoftext|>` as id 0, from an iterator of text batches."""
    from tokenizers import pre_tokenizers, trainers

    minimum = len(pre_tokenizers.ByteLevel.alphabet()) + 1
    if vocab_size < minimum:
        raise ValueError(
            f"vocabulary size {vocab_size} is too small: a byte-level BPE needs at least {minimum}"
        )
    tokenizer = new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[TRAINED_EOS],
        # Every byte is in the vocabulary from the start, so any text can be encoded and nothing is unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=length)
    return tokenizer


def curated_parquet_files(path: str) -> list[str]:
    """Parquet files of a curated folder (every cell), a single file, or a glob; sorted.

    A folder is read as curated/ (domain=*/quality=*/*.parquet, at any depth) when it has that layout, else
    every Parquet file below it.
    """
    if any(c in path for c in "*?[") or path.endswith(".parquet"):
        files = storage.expand_glob(path)
    else:
        # Cell folders first, at any depth: a curate output folder's removed/ documents are never taken.
        files = storage.expand_glob(storage.join(path, "**", "domain=*", "quality=*", "*.parquet"))
        files = files or storage.expand_glob(storage.join(path, "**", "*.parquet"))
    return [f for f in files if not os.path.basename(f).startswith(storage.TEMPORARY_PREFIX)]


def iter_text_batches(
    files: list[str], max_documents: int | None, batch_size: int = 1000
) -> Iterator[list[str]]:
    """Text column of the files in batches, at most `max_documents` in all, spread over every file.

    Each file gets an equal share of what is left of the budget, so a capped sample draws from every cell
    rather than only the first ones in sorted order; a file with fewer documents leaves its unused share to
    the files after it.
    """
    import pyarrow.parquet as pq

    remaining = max_documents if max_documents is not None else None
    for position, path in enumerate(files):
        if remaining is not None:
            if remaining <= 0:
                return
            quota = -(-remaining // (len(files) - position))
        else:
            quota = None
        taken = 0
        with storage.open_file(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            for batch in parquet.iter_batches(batch_size=batch_size, columns=["text"]):
                texts = [t for t in batch.column(0).to_pylist() if t]
                if quota is not None:
                    texts = texts[: quota - taken]
                if texts:
                    taken += len(texts)
                    yield texts
                if quota is not None and taken >= quota:
                    break
        if remaining is not None:
            remaining -= taken
