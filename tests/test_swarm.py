"""Mixture search (docs/search.md): the swarm's sampling (seeded, within every epoch cap, no duplicates), the
fit's out-of-fold quality on a known law, the proposal's caps, evidence keyed to content (changed cells
refused, renamed cells accepted), a killed swarm resuming without rerunning what finished, and the errors
of bad input.

The corpus is written here: three domains with disjoint vocabularies, so that a proxy's held-out loss on
each domain depends on how much of it the proxy trained on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_heldout import write_rows

from tokenmill.cli import main
from tokenmill.formats.swarm import (
    RESULT,
    ProxyResult,
    read_fit,
    read_proposal,
    read_result,
    read_swarm,
    read_validation,
    write_result,
)
from tokenmill.mixtures import load_mixture
from tokenmill.swarm.build import sha256_text
from tokenmill.swarm.fit import fit_loglinear, out_of_fold, spearman
from tokenmill.swarm.sample import SearchSpace, sample_mixtures, water_fill
from tokenmill.swarm.validate import judge, set_up

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "models" / "tiny.yaml"
VOCABULARIES = {
    "alpha": "river stone meadow cloud harbor lantern willow ember orchard canyon".split(),
    "beta": "vector matrix kernel tensor gradient lambda sigma cosine theta prime".split(),
    "gamma": "violin sonata rhythm chord tempo melody choir octave ballad lyric".split(),
}


def text_of(domain: str, number: int) -> str:
    rng = np.random.default_rng(zlib.crc32(f"{domain}:{number}".encode()))
    words = VOCABULARIES[domain]
    return " ".join(words[i] for i in rng.integers(0, len(words), size=int(rng.integers(20, 60)))) + ".\n"


def base_mixture(sources: dict, weights: dict[str, float] | None = None, **fields) -> str:
    weights = weights or {name: 1 / len(sources) for name in sources}
    spec = {
        "name": "swarm-test",
        "tokenizer": "tokenmill-bpe-300",
        "total_tokens": 24_000,
        "sequence_length": 32,
        "batch_size": 4,
        "block_size": 16,
        "max_epochs": 8,
        "sources": sources,
        "phases": [
            {"name": "pretraining", "share": 0.75, "weights": weights},
            {"name": "midtraining", "share": 0.25, "weights": weights},
        ],
        "evaluation": {"heldout": "domain=*/*", "group_by": "domain"},
        **fields,
    }
    return yaml.safe_dump(spec, sort_keys=False)


SOURCES = {"a": "domain=alpha/*", "b": "domain=beta/*", "g": "domain=gamma/*"}


def tokenize(curated: Path, tokenizer: Path, tokens: Path) -> None:
    argv = ["tokenize", "--input", str(curated), "--output", str(tokens), "--tokenizer", str(tokenizer),
            "--workers", "1", "--progress-seconds", "0", "--heldout-fraction", "0.1",
            "--heldout-min-documents", "3", "--overwrite"]  # fmt: skip
    assert main(argv) == 0


def write_corpus(curated: Path, extra: int = 0) -> None:
    for domain, count in (("alpha", 120), ("beta", 60), ("gamma", 30)):
        if domain == "gamma":
            count += extra
        rows = [(f"{domain}/part.jsonl:{n}", text_of(domain, n)) for n in range(count)]
        write_rows(curated, domain, 3, 0, 1, rows)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("swarm")
    curated = root / "curated"
    write_corpus(curated)
    tokenizer = root / "tokenizer.json"
    argv = ["tokenizer", "train", "--input", str(curated), "--vocab-size", "300", "--output", str(tokenizer)]
    assert main(argv) == 0
    tokens = root / "tokens"
    tokenize(curated, tokenizer, tokens)
    base = root / "base.yaml"
    base.write_text(base_mixture(SOURCES))
    run_config = root / "proxy.yaml"
    run_config.write_text(
        yaml.safe_dump(
            {
                "model": str(TINY),
                "optimizer": {"lr": 0.01},
                "evaluation": {"sequences": 16},
                "checkpoint": {"every": 1000, "keep": 1, "asynchronous": False},
                "logging": {"expert_load_every": 1000},
            }
        )
    )
    return {"root": root, "curated": curated, "tokenizer": tokenizer, "tokens": tokens, "base": base,
            "run_config": run_config}  # fmt: skip


def make_swarm(corpus: dict, output: Path, *extra: str, proxies: int = 12, base: Path | None = None) -> int:
    return main(
        [
            "mixture",
            "swarm",
            str(base or corpus["base"]),
            "--run-config",
            str(corpus["run_config"]),
            "--tokens",
            str(corpus["tokens"]),
            "--proxies",
            str(proxies),
            "--proxy-tokens",
            "2K",
            "--output",
            str(output),
            *extra,
        ]  # fmt: skip
    )


# ---------------------------------------------------------------------------------------------------------
# Sampling


def space_with(tokens: list[float], caps: list[float], fixed: list[float] | None = None) -> SearchSpace:
    available = np.array(tokens, dtype=float)
    return SearchSpace(
        names=tuple(f"s{i}" for i in range(len(tokens))),
        prior=available / available.sum(),
        tokens_available=available,
        max_epochs=np.array(caps, dtype=float),
        fixed_epochs=np.array(fixed or [0.0] * len(tokens)),
        phase_tokens=100_000,
        block_size=64,
    )


def test_the_same_seed_gives_the_same_mixtures_and_another_seed_others():
    space = space_with([60_000, 30_000, 9_000, 1_000], [4, 4, 4, 8])
    first = sample_mixtures(space, 40, seed=3)
    again = sample_mixtures(space, 40, seed=3)
    other = sample_mixtures(space, 40, seed=4)
    assert [d.weights.tolist() for d in first.draws] == [d.weights.tolist() for d in again.draws]
    assert [d.weights.tolist() for d in first.draws] != [d.weights.tolist() for d in other.draws]


def test_every_mixture_is_distinct_whole_blocks_within_every_cap():
    # A hot spot: the smallest source can take at most 8% of the phase; the others cap the rest.
    space = space_with([60_000, 30_000, 9_000, 1_000], [1.2, 2, 4, 8])
    report = sample_mixtures(space, 60, seed=0, anchors=[("uniform", space.uniform())])
    keys = [space.block_key(d.weights) for d in report.draws]
    assert len(set(keys)) == len(keys) == 60
    for draw in report.draws:
        assert np.isclose(draw.weights.sum(), 1.0)
        assert np.all(space.epochs(draw.weights) <= space.max_epochs + 1e-9)
        assert np.allclose(draw.weights * 64, np.round(draw.weights * 64))
    # Uniform (25% of the smallest source: 25 epochs) breaks a cap: it was refused, and counted.
    assert report.rejected_over_cap >= 1
    assert all(d.kind != "uniform" for d in report.draws)
    # The spread of concentrations reaches both corners and the neighbourhood of the prior.
    largest = np.array([d.weights.max() for d in report.draws])
    assert largest.max() > 0.6 and largest.min() < 0.5


def test_caps_that_leave_no_mixture_and_a_single_source_are_errors():
    with pytest.raises(ValueError, match="no mixture fits"):
        sample_mixtures(space_with([1_000, 1_000], [1, 1]), 4, seed=0)
    with pytest.raises(ValueError, match="two sources or more"):
        sample_mixtures(space_with([1_000], [10]), 4, seed=0)


def test_water_fill_keeps_the_caps_and_the_proportions_of_the_rest():
    upper = np.array([0.1, 1.0, 1.0])
    filled = water_fill(np.array([0.5, 0.3, 0.2]), upper)
    assert np.isclose(filled.sum(), 1) and filled[0] == pytest.approx(0.1)
    assert filled[1] / filled[2] == pytest.approx(1.5)


# ---------------------------------------------------------------------------------------------------------
# The fit, on a known law


def test_the_log_linear_fit_predicts_unseen_mixtures_of_a_known_law():
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(4), size=40)
    effects = np.array([-1.5, -0.2, 0.4, 0.9])
    values = 0.8 + np.exp(0.1 + weights @ effects) + rng.normal(0, 0.003, 40)
    model = fit_loglinear(weights, values)
    assert 0 <= model.floor < values.min()

    def fit_predict(train, test):
        return fit_loglinear(weights[train], values[train]).predict(weights[test])

    predicted = out_of_fold(40, 5, 0, fit_predict)
    assert spearman(values, predicted) > 0.95
    # Effects are defined up to a constant (the weights sum to 1): their order is the law's.
    assert list(np.argsort(model.effects)) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------------
# Swarms on the corpus


def law(weights: dict[str, float], set_name: str) -> float:
    """A made-up but plausible outcome: each domain's bits per byte fall with its own share of the data."""
    own = {"heldout/domain=alpha": "a", "heldout/domain=beta": "b", "heldout/domain=gamma": "g"}[set_name]
    return 1.0 + 2.0 * np.exp(-3.0 * weights[own]) + 0.05 * weights["a"]


def finished(job_id: str, run_config: str, metrics: dict) -> ProxyResult:
    """A finished proxy's result, as the worker writes it, for the run configuration text given."""
    return ProxyResult(
        id=job_id, status="finished", run_config_sha256=sha256_text(run_config), seconds=1.0, metrics=metrics
    )


def write_law_results(swarm: Path) -> None:
    """Results for every proxy from `law`, as a finished proxy would record them (for fit and propose)."""
    manifest = read_swarm(str(swarm / "swarm.json"))
    for proxy in manifest.proxies:
        values = {s.name: law(proxy.weights, s.name) for s in manifest.evaluation}
        metrics = {name: {"bits_per_byte": value, "loss": 2 * value} for name, value in values.items()}
        values = [m["bits_per_byte"] for m in metrics.values()]
        metrics["heldout_macro"] = {
            "bits_per_byte": float(np.mean(values)),
            "loss": 2 * float(np.mean(values)),
        }
        config = (swarm / proxy.run_config).read_text()
        write_result(str(swarm / proxy.id / RESULT), finished(proxy.id, config, metrics))


def test_the_same_command_writes_the_same_swarm(corpus, tmp_path):
    assert make_swarm(corpus, tmp_path / "one", "--seed", "5") == 0
    assert make_swarm(corpus, tmp_path / "two", "--seed", "5") == 0
    one, two = (
        read_swarm(str(tmp_path / "one" / "swarm.json")),
        read_swarm(str(tmp_path / "two" / "swarm.json")),
    )
    assert [p.weights for p in one.proxies] == [p.weights for p in two.proxies]
    # The base's weights are uniform here: the base anchor is the uniform one, a duplicate, drawn again.
    assert [p.kind for p in one.proxies[:2]] == ["prior", "uniform"]
    assert {p.kind for p in one.proxies[2:]} == {"sampled"} and one.rejected_duplicate >= 1
    # Each proxy's mixture is the base with its weights: planned, it trains exactly those weights.
    proxy = one.proxies[5]
    spec = load_mixture(str(tmp_path / "one" / proxy.mixture))
    weights = {name: float(w) for name, w in spec.phases[0].weights.items()}
    assert weights == pytest.approx(proxy.weights)
    assert {name: float(w) for name, w in spec.phases[1].weights.items()} == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "g": 1 / 3}
    )
    # The sources are keyed by their cells' content, the evaluation sets by their held-out shards.
    assert len({s.content for s in one.sources}) == 3
    assert [s.name for s in one.evaluation] == [f"heldout/domain={d}" for d in ("alpha", "beta", "gamma")]
    assert make_swarm(corpus, tmp_path / "one") == 2  # exists: refused without --overwrite


def test_the_proposal_respects_every_cap_and_beats_the_prior_under_the_law(corpus, tmp_path, capsys):
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, proxies=16) == 0
    write_law_results(swarm)
    assert main(["mixture", "fit", str(swarm)]) == 0
    fit = read_fit(str(swarm / "fit.json"))
    macro = next(m for m in fit.metrics if m.metric == "heldout_macro:bits_per_byte")
    loglinear = next(q for q in macro.quality if q.model == "loglinear")
    assert loglinear.spearman > 0.8 and len(loglinear.predicted) == 16
    proposed = tmp_path / "proposed.yaml"
    assert main(["mixture", "propose", str(swarm), "--output", str(proposed)]) == 0
    proposal = read_proposal(str(swarm / "proposal.json"))
    for name, epochs in proposal.epochs.items():
        assert epochs <= proposal.max_epochs[name] + 1e-9
    sets = ("heldout/domain=alpha", "heldout/domain=beta", "heldout/domain=gamma")
    assert np.mean([law(proposal.weights, s) for s in sets]) < np.mean([law(proposal.prior, s) for s in sets])
    # The mixture written plans (shortfall: error) and says where it comes from.
    spec = yaml.safe_load(proposed.read_text())
    assert spec["search"]["swarm"] == str(swarm) and spec["search"]["phase"] == "pretraining"
    assert main(["mixture", "check", str(proposed), "--counts", str(corpus["tokens"] / "counts.json")]) == 0


def test_validation_judges_the_proposal_by_twice_the_seed_spread(corpus, tmp_path):
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, proxies=10) == 0
    write_law_results(swarm)
    assert main(["mixture", "fit", str(swarm)]) == 0
    assert main(["mixture", "propose", str(swarm), "--output", str(tmp_path / "p.yaml")]) == 0
    manifest = read_swarm(str(swarm / "swarm.json"))
    validation = set_up(str(swarm), manifest, 4.0, [0, 1, 2], None)
    arms = ("proposal", "prior", "uniform")
    assert [job.id for job in validation.jobs] == [f"{arm}-s{seed}" for arm in arms for seed in (0, 1, 2)]
    # Each run is the arm's mixture at 4x a proxy's tokens, with its own seed.
    spec = yaml.safe_load((swarm / "validation" / "prior-s2" / "mixture.yaml").read_text())
    assert spec["total_tokens"] == 8_000
    assert yaml.safe_load((swarm / "validation" / "prior-s2" / "run.yaml").read_text())["seed"] == 2
    # The law with a seed's noise: the proposal's margin over the prior is large, over uniform small.
    noise = {0: -0.01, 1: 0.0, 2: 0.01}
    for job in validation.jobs:
        value = float(np.mean([law(job.weights, s.name) for s in manifest.evaluation])) + noise[job.seed]
        config = (swarm / "validation" / job.run_config).read_text()
        metrics = {"heldout_macro": {"bits_per_byte": value, "loss": 2 * value}}
        write_result(str(swarm / "validation" / job.id / RESULT), finished(job.id, config, metrics))
    judged = judge(str(swarm), validation)
    arms = {arm.name: arm for arm in judged.arms}
    assert arms["proposal"].std == pytest.approx(0.01)
    for other in ("prior", "uniform"):
        margin = arms[other].mean - arms["proposal"].mean
        assert judged.margins[other] == pytest.approx(margin)
        assert judged.beats[other] == (margin > 0.02)
    assert read_validation(str(swarm / "validation" / "validation.json")).beats == judged.beats


def test_tight_caps_bind_the_proposal(corpus, tmp_path):
    # gamma may be trained once: under the law it would take more than the room that leaves.
    base = tmp_path / "base.yaml"
    gamma_once = {**SOURCES, "g": {"cells": "domain=gamma/*", "max_epochs": 1}}
    base.write_text(base_mixture(gamma_once, {"a": 0.45, "b": 0.45, "g": 0.1}))
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, proxies=16, base=base) == 0
    manifest = read_swarm(str(swarm / "swarm.json"))
    gamma = next(s for s in manifest.sources if s.name == "g")
    for proxy in manifest.proxies:  # caps are checked at the target budget, midtraining's epochs counted
        assert gamma.fixed_epochs + proxy.weights["g"] * manifest.phase_tokens / gamma.tokens_available <= 1
    write_law_results(swarm)
    assert main(["mixture", "fit", str(swarm)]) == 0
    assert main(["mixture", "propose", str(swarm), "--output", str(tmp_path / "p.yaml")]) == 0
    proposal = read_proposal(str(swarm / "proposal.json"))
    assert proposal.epochs["g"] <= 1.0 + 1e-9
    # At the cap, up to one sequence of a block (1/16 of the phase) rounded off.
    assert proposal.epochs["g"] > 1.0 - manifest.phase_tokens / 16 / gamma.tokens_available


def test_a_later_phase_is_searched_with_the_first_fixed(corpus, tmp_path):
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, "--phase", "midtraining", proxies=6) == 0
    manifest = read_swarm(str(swarm / "swarm.json"))
    assert manifest.phase == "midtraining"
    assert all(s.fixed_epochs > 0 for s in manifest.sources)  # pretraining's epochs count against the caps
    spec = load_mixture(str(swarm / manifest.proxies[4].mixture))
    assert {n: float(w) for n, w in spec.phases[0].weights.items()} == pytest.approx(
        {"a": 1 / 3, "b": 1 / 3, "g": 1 / 3}
    )
    assert {n: float(w) for n, w in spec.phases[1].weights.items()} == pytest.approx(
        manifest.proxies[4].weights
    )


def test_changed_cells_are_refused_and_renamed_cells_keep_their_evidence(corpus, tmp_path, capsys):
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, proxies=8) == 0
    write_law_results(swarm)
    # Re-curated: gamma gained documents; its cells' shards (and content key) changed.
    changed = tmp_path / "changed"
    write_corpus(changed / "curated", extra=6)
    tokenize(changed / "curated", corpus["tokenizer"], changed / "tokens")
    assert main(["mixture", "fit", str(swarm), "--tokens", str(changed / "tokens")]) == 2
    assert "content changed: g" in capsys.readouterr().err
    assert main(["mixture", "fit", str(swarm), "--tokens", str(changed / "tokens"), "--reuse-evidence"]) == 0
    assert read_fit(str(swarm / "fit.json")).evidence_reused == ["g"]
    # Renamed: the gamma domain is now "music", the source "m"; the same documents.
    renamed = tmp_path / "renamed"
    shutil.copytree(corpus["tokens"], renamed)
    (renamed / "domain=gamma").rename(renamed / "domain=music")
    counts = json.loads((renamed / "counts.json").read_text())
    counts["cells"] = {
        cell.replace("gamma", "music"): {
            key: value.replace("gamma", "music") if isinstance(value, str) else value
            for key, value in entry.items()
        }
        for cell, entry in counts["cells"].items()
    }
    (renamed / "counts.json").write_text(json.dumps(counts))
    base = tmp_path / "renamed.yaml"
    base.write_text(base_mixture({"a": "domain=alpha/*", "b": "domain=beta/*", "m": "domain=music/*"}))
    argv = ["mixture", "fit", str(swarm), "--tokens", str(renamed), "--base", str(base)]
    assert main(argv) == 0
    assert read_fit(str(swarm / "fit.json")).evidence_reused == []
    argv = ["mixture", "propose", str(swarm), "--tokens", str(renamed), "--base", str(base), "--output",
            str(tmp_path / "p.yaml")]  # fmt: skip
    assert main(argv) == 0
    assert set(read_proposal(str(swarm / "proposal.json")).weights) == {"a", "b", "m"}


def test_bad_input_names_what_is_missing(corpus, tmp_path, capsys):
    one_source = tmp_path / "one.yaml"
    one_source.write_text(base_mixture({"a": "domain=*/*"}))
    assert make_swarm(corpus, tmp_path / "s1", base=one_source) == 2
    assert "two sources or more" in capsys.readouterr().err
    no_eval = tmp_path / "noeval.yaml"
    spec = yaml.safe_load(base_mixture(SOURCES))
    del spec["evaluation"]
    no_eval.write_text(yaml.safe_dump(spec))
    assert make_swarm(corpus, tmp_path / "s2", base=no_eval) == 2
    assert "names no evaluation sets" in capsys.readouterr().err
    # A swarm whose proxies failed or lack an evaluation: fewer than sources + 1 usable, named.
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, proxies=4) == 0
    write_law_results(swarm)
    manifest = read_swarm(str(swarm / "swarm.json"))
    first, second = manifest.proxies[0], manifest.proxies[1]
    failed = read_result(str(swarm / first.id / RESULT)).model_copy(
        update={"status": "failed", "error": "boom"}
    )
    write_result(str(swarm / first.id / RESULT), failed)
    partial = read_result(str(swarm / second.id / RESULT))
    partial = partial.model_copy(
        update={"metrics": {"heldout/domain=alpha": partial.metrics["heldout/domain=alpha"]}}
    )
    write_result(str(swarm / second.id / RESULT), partial)
    assert main(["mixture", "fit", str(swarm)]) == 2
    error = capsys.readouterr().err
    assert "2 finished proxies" in error and "3 sources + 1" in error
    assert first.id in error and second.id in error
    assert main(["mixture", "propose", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x.yaml")]) == 2
    assert "not a swarm" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# Real proxies


@pytest.mark.slow  # make test-slow: about 50 s on 2 cores (test_launch_swarm.py: finished proxies skipped)
def test_a_killed_swarm_resumes_without_rerunning_finished_proxies(corpus, tmp_path):
    swarm = tmp_path / "swarm"
    assert make_swarm(corpus, swarm, proxies=4) == 0
    command = [sys.executable, "-m", "tokenmill", "mixture", "run", str(swarm), "--workers", "1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)  # fmt: skip
    results = [swarm / f"proxy-00{i}" / RESULT for i in range(4)]
    deadline = time.monotonic() + 300
    while not results[0].exists() and time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read().decode()
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)  # the runner and its worker, as a scheduler's kill would
    process.wait(timeout=60)
    finished = {path: path.stat().st_mtime_ns for path in results if path.exists()}
    assert results[0] in finished and len(finished) < 4
    output = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert output.returncode == 0, output.stdout + output.stderr
    assert f"{len(finished)} of 4 already finished" in output.stderr
    for path, mtime in finished.items():
        assert path.stat().st_mtime_ns == mtime  # not run again
    for path in results:
        result = read_result(str(path))
        assert result.status == "finished"
        # Scored at the end, dropless, on every domain's held-out slice, and the macro over them.
        assert {
            "heldout/domain=alpha",
            "heldout/domain=beta",
            "heldout/domain=gamma",
            "heldout_macro",
        } <= set(result.metrics)
        assert result.steps == 16  # 2K tokens in steps of 4 x 32
