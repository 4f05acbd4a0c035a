"""Benchmark: `tokenmill tokenize` end to end against HF tokenizers' encode_batch alone, and its peak memory.

The limit for a tokenizer is `encode_batch` on texts already in memory, on the same cores: that is all
tokenizing is, with no reading, writing, checksums or Beam. The bench builds a synthetic curated corpus
(code from Python's own standard library, prose drawn from its words, and some Greek, Cyrillic and CJK
text), trains a byte-level BPE on it, then

  1. runs `tokenmill tokenize` as a subprocess on a corpus of S and of 2S (more files of the same size, as
     a growing corpus has), polling the peak resident memory of the whole process tree, and
  2. times `encode_batch` and `encode_batch_fast` alone over the larger corpus's texts held in memory, and
     holds the pipeline to the faster of the two.

(This file is not called bench/tokenize.py, the name the issue used: bench/ is first on sys.path when a
bench script runs, and a file named after the standard library's `tokenize` breaks every script there.)

The ratio is the pipeline's tokens/s (wall clock, process start to exit) over the baseline's. Wall clock
on a shared machine is noisy, so the CPU seconds of both are printed too, and their ratio. Run under
`nice`; sizes are modest so it finishes in a few minutes on two shared cores. The last line is the result.
"""

from __future__ import annotations

import argparse
import glob
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.8


def source_texts() -> list[str]:
    """Python's standard library sources: the same on every machine with this Python."""
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for path in sorted(
        glob.glob(os.path.join(stdlib, "*.py")) + glob.glob(os.path.join(stdlib, "*", "*.py"))
    ):
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def make_documents(count: int, seed: int, code: list[str], words: list[str]) -> list[str]:
    """Documents of about 1-8k characters: 40% code, 50% English-like prose, 10% other scripts."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, len(words) + 1)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    scripts = [(0x0391, 0x03C9), (0x0410, 0x044F), (0x4E00, 0x4FFF), (0x3041, 0x3096)]
    documents = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.4:
            text = code[int(rng.integers(len(code)))]
            start = int(rng.integers(max(1, len(text) - 4000)))
            documents.append(text[start : start + int(rng.integers(1000, 8000))])
        elif kind < 0.9:
            picks = rng.choice(len(words), size=int(rng.integers(150, 1200)), p=zipf)
            sentence = " ".join(words[i] for i in picks)
            documents.append(sentence.replace(" the ", ". The ", 3) + ".\n")
        else:
            low, high = scripts[int(rng.integers(len(scripts)))]
            chars = rng.integers(low, high, size=int(rng.integers(300, 2000)))
            spaces = rng.random(len(chars)) < 0.15
            documents.append("".join(" " if s else chr(c) for c, s in zip(chars, spaces, strict=True)))
    return documents


def write_corpus(root: Path, files: int, documents_per_file: int, code: list[str], words: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.formats.documents import DOCUMENT_SCHEMA

    cells = ["domain=code/quality=3", "domain=web/quality=2"]
    for n in range(files):
        texts = make_documents(documents_per_file, seed=n, code=code, words=words)
        m = len(texts)
        cell = cells[n % len(cells)]
        domain, quality = cell.split("/")[0][7:], int(cell[-1])
        columns = {
            "id": [f"bench:{n}:{i:07d}" for i in range(m)],
            "text": texts,
            "source": ["bench"] * m,
            "url": [None] * m,
            "metadata": ["{}"] * m,
            "language": ["en"] * m,
            "language_score": [1.0] * m,
            "quality_score": [0.5] * m,
            "quality": [quality] * m,
            "domain": [domain] * m,
            "domain_score": [1.0] * m,
            "n_chars": [len(t) for t in texts],
            "n_words": [len(t.split()) for t in texts],
            "dup_cluster": [None] * m,
            "dup_cluster_size": [1] * m,
            "pii": [None] * m,
        }
        table = pa.table(columns, schema=DOCUMENT_SCHEMA)
        path = root / cell / f"part-{n // len(cells):05d}-of-{files // len(cells):05d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path, compression="zstd")


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        total += rss.get(current, 0)
        stack.extend(children.get(current, []))
    return total


def cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def run_measured(command: list[str]) -> tuple[float, float, int, str]:
    """Run a command; returns (wall seconds, CPU seconds, peak resident bytes of its process tree, output).

    CPU seconds cover the command and every process it waited for (Beam's workers included).
    """
    cpu_before = cpu_seconds(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.05)
    seconds = time.monotonic() - started
    output = process.stdout.read() if process.stdout else ""
    if process.returncode:
        sys.exit(f"failed ({process.returncode}): {' '.join(command)}\n{output}")
    return seconds, cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_before, peak, output


def baseline(tokenizer_path: Path, curated: Path, batch: int = 512) -> dict[str, tuple[float, float]]:
    """HF tokenizers alone over the corpus's texts, already in memory: {method: (wall s, CPU s)}.

    Both `encode_batch` and `encode_batch_fast` (no character offsets; what the pipeline calls), in the
    pipeline's batch size; the faster is the limit the pipeline is held to.
    """
    import pyarrow.parquet as pq

    from tokenmill.tokenize.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(str(tokenizer_path))
    texts: list[str] = []
    for path in sorted(curated.rglob("*.parquet")):
        texts.extend(pq.read_table(path, columns=["text"]).column(0).to_pylist())
    results = {}
    for method in ("encode_batch", "encode_batch_fast"):
        encode = getattr(tokenizer, method)
        cpu_before = cpu_seconds(resource.RUSAGE_SELF)
        started = time.monotonic()
        for i in range(0, len(texts), batch):
            encode(texts[i : i + batch], add_special_tokens=False)
        results[method] = (time.monotonic() - started, cpu_seconds(resource.RUSAGE_SELF) - cpu_before)
    return results


def main() -> None:
    from tokenmill.formats.tokens import COUNTS, read_counts

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--files", type=int, default=4, help="Parquet files in the smaller corpus (the larger has 2x)"
    )
    parser.add_argument("--documents-per-file", type=int, default=2500)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--workers", type=int, default=0, help="tokenize --workers (default: one per core)")
    parser.add_argument("--keep", help="folder to keep the corpus and shards in (default: a temporary one)")
    args = parser.parse_args()
    os.nice(10)  # a shared machine: others come first; children inherit it

    work = Path(args.keep or tempfile.mkdtemp(prefix="tokenmill-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    cli = [python, "-m", "tokenmill"]
    print(f"cores: {os.cpu_count()}; work folder: {work}")
    try:
        code = source_texts()
        words = sorted({w for text in code for w in text.split() if w.isalpha() and w.islower()})
        sizes = {"S": args.files, "2S": 2 * args.files}
        for label, files in sizes.items():
            curated = work / f"curated-{label}"
            if not curated.exists():
                write_corpus(curated, files, args.documents_per_file, code, words)
        tokenizer = work / "tokenizer.json"
        subprocess.run(
            [
                *cli,
                "tokenizer",
                "train",
                "--input",
                str(work / "curated-S"),
                "--output",
                str(tokenizer),
                "--vocab-size",
                str(args.vocab_size),
                "--max-documents",
                "3000",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        results = {}
        for label in sizes:
            tokens_dir = work / f"tokens-{label}"
            shutil.rmtree(tokens_dir, ignore_errors=True)
            command = [
                *cli,
                "tokenize",
                "--input",
                str(work / f"curated-{label}"),
                "--output",
                str(tokens_dir),
                "--tokenizer",
                str(tokenizer),
                "--workers",
                str(args.workers),
                "--progress-seconds",
                "0",
            ]
            seconds, cpu, peak, _ = run_measured(command)
            counts = read_counts(str(tokens_dir / COUNTS))
            parquet = sum(p.stat().st_size for p in (work / f"curated-{label}").rglob("*.parquet"))
            tokens = counts.total_tokens or 0
            results[label] = (seconds, cpu, peak, tokens)
            print(
                f"tokenize {label}: {sizes[label]} files, {counts.total_documents or 0:,} documents, "
                f"{tokens:,} tokens ({parquet / 1e6:.0f} MB Parquet): {seconds:.1f} s wall, {cpu:.1f} s CPU, "
                f"{tokens / seconds:,.0f} tokens/s; peak memory of the process tree {peak / 2**20:,.0f} MiB"
            )
        seconds, cpu, _, tokens = results["2S"]
        methods = baseline(tokenizer, work / "curated-2S")
        for method, (base_seconds, base_cpu) in methods.items():
            print(
                f"{method} alone on 2S in memory: {base_seconds:.1f} s wall, {base_cpu:.1f} s CPU, "
                f"{tokens / base_seconds:,.0f} tokens/s"
            )
        base_seconds = min(wall for wall, _ in methods.values())
        base_cpu = min(cpu for _, cpu in methods.values())
        print(f"peak memory 2S/S: {results['2S'][2] / results['S'][2]:.2f}x for 2x the corpus")
        print(f"CPU-time ratio (less sensitive to other users of the machine): {base_cpu / cpu:.2f}")
        ratio = base_seconds / seconds  # same tokens on both sides: the ratio of tokens/s
        print(f"tokenize ratio={ratio:.2f} target={TARGET} baseline=hf_encode_batch")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
