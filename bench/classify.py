"""Benchmark: the domain and quality classification stages inside `tokenmill curate` against fastText's
predict called on the same texts in a loop, and the held-out accuracy of each bundled model.

The bundled models are trained first (tokenmill.samples.classifier_data, `tokenmill classifier train`);
then a corpus of documents runs through a curate pipeline whose stages are just the two classifiers.
The stages' own time comes from the pipeline's counters (CPU time inside each step, summed over workers),
so the comparison is per core, like the loop. Each side runs `--repeats` times, in turns, and each
side's best run is compared (a side takes one or two CPU-seconds, which this shared machine's drift moves
by a fifth).

    python bench/classify.py [--documents 20000] [--repeats 3]

Last line: `classify ratio=X.XX target=0.7 baseline=fasttext_predict_loop` (stage documents per CPU second
over the loop's documents per second).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, in turns; the best counts")
    args = parser.parse_args()
    import fasttext  # noqa: F401 - fail early if missing

    from tokenmill.cli import main as tokenmill
    from tokenmill.filters.classifiers import fasttext_text, load_fasttext
    from tokenmill.formats.cards import CARD, read_card

    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        # In a fresh process: the generated text depends on the modules loaded (tokenmill.samples.text).
        subprocess.run(
            [sys.executable, "-m", "tokenmill.samples.classifier_data", "--output", str(root / "data")],
            check=True,
            capture_output=True,
        )
        for kind, extra in (
            ("domain", []),
            ("quality", ["--calibration", str(root / "data" / "calibration.jsonl")]),
        ):
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tokenmill",
                    "classifier",
                    "train",
                    "--kind",
                    kind,
                    "--input",
                    str(root / "data" / f"{kind}.jsonl"),
                    "--output",
                    str(root / kind),
                    *extra,
                ],
                check=True,
                capture_output=True,
            )
        texts = [
            json.loads(line)["text"] for line in (root / "data" / "quality.jsonl").read_text().splitlines()
        ]
        texts = [
            f"{text}\n\n(copy {i // len(texts)})"
            for i, text in zip(range(args.documents), (texts * (args.documents // len(texts) + 1)))
        ]
        corpus = root / "corpus.jsonl"
        corpus.write_text(
            "".join(json.dumps({"id": f"d{i:07d}", "text": t}) + "\n" for i, t in enumerate(texts))
        )
        recipe = root / "recipe.yaml"
        recipe.write_text(
            f"name: classify\nstages:\n  - domain_classifier: {{model: {root}/domain}}\n"
            f"  - quality_classifier: {{model: {root}/quality}}\n"
        )

        from tokenmill.pipelines.curate import stage_seconds  # noqa: F401 - the counters the summary prints

        domain_model = load_fasttext(str(root / "domain" / "model.bin"))
        quality_model = load_fasttext(str(root / "quality" / "model.bin"))
        # Each side is timed `--repeats` times, in turns, and each side's best is compared: a side takes
        # 1-2 CPU-seconds, where this shared machine's drift is a fifth.
        stage_times, loop_times, walls = [], [], []
        for repeat in range(args.repeats):
            wall, stage_time = _pipeline_seconds(tokenmill, recipe, corpus, root / f"out-{repeat}")
            walls.append(wall)
            stage_times.append(stage_time)
            started = time.process_time()
            for text in texts:
                # fastText reads one line per example, so the loop prepares each text as the stage does.
                line = fasttext_text(text, 4000)
                domain_model.predict(line)
                quality_model.predict(line, k=-1)
            loop_times.append(time.process_time() - started)
        stage_time, loop_time, wall = min(stage_times), min(loop_times), min(walls)

        for kind in ("domain", "quality"):
            card = read_card(str(root / kind / CARD))
            if card.holdout_metrics is None or card.data is None:
                print(f"{kind} model: no held-out metrics in its card")
                continue
            print(
                f"{kind} model: held-out accuracy {card.holdout_metrics.accuracy:.3f} on "
                f"{card.data.holdout} examples (bundled data: tokenmill.samples.classifier_data)"
            )
        stage_rate = len(texts) / stage_time
        loop_rate = len(texts) / loop_time
        print(f"documents: {len(texts):,}; curate wall time {wall:.1f}s (one worker)")
        print(
            f"classification stages inside the pipeline: {stage_time:.2f} CPU s, {stage_rate:,.0f} docs/s "
            f"(runs {', '.join(f'{seconds:.2f}' for seconds in stage_times)})"
        )
        print(
            f"fastText predict loop, both models: {loop_time:.2f} CPU s, {loop_rate:,.0f} docs/s "
            f"(runs {', '.join(f'{seconds:.2f}' for seconds in loop_times)})"
        )
        print(f"classify ratio={stage_rate / loop_rate:.2f} target=0.7 baseline=fasttext_predict_loop")
    return 0


def _pipeline_seconds(tokenmill, recipe: Path, corpus: Path, output: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds inside the two classifier steps) of one curate run on one worker."""
    output_text = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(output_text):
        arguments = ["--recipe", str(recipe), "--input", str(corpus), "--output", str(output)]
        status = tokenmill(["curate", *arguments, "--workers", "1"])
    wall = time.perf_counter() - started
    assert status == 0, output_text.getvalue()
    line = next(row for row in output_text.getvalue().splitlines() if "CPU seconds inside each step" in row)
    seconds = dict(part.strip().rsplit(" ", 1) for part in line.split(":", 1)[1].split(","))
    return wall, float(seconds["domain_classifier"]) + float(seconds["quality_classifier"])


if __name__ == "__main__":
    sys.exit(main())
