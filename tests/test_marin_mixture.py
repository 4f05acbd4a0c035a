"""The reference run's mixture as run: Marin's Harrier 2026-08-18 mix (200 cells, both phases' published
weights, 8-epoch cap), planned to 390,251 steps of 11,264 x 4,096 tokens in 49,152-sequence blocks with
midtraining from step 312,192, and the ladder's slices of it."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from tokenmill.cli import main
from tokenmill.mixtures import load_mixture, plan_mixture

REPO = Path(__file__).resolve().parents[1]
HERO = REPO / "mixtures" / "marin-535b-a23b.yaml"
# Each rung's slice: racks, steps (launch_scaling_ladder.py).
LADDER = {"48b": (1, 11_420), "128b": (2, 15_276), "381b": (6, 15_128), "926b": (11, 20_072)}
CELLS = [f"c{cluster:02d}q{quality}" for cluster in range(40) for quality in range(5)]


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(HERO.read_text())


@pytest.fixture(scope="module")
def hero_plan():
    return plan_mixture(load_mixture(HERO))


def budget_epochs(raw: dict) -> dict[str, float]:
    """Each cell's epochs at the mixture's 15T + 3.75T budget, from the published numbers alone."""
    pre, mid = raw["phases"]
    return {
        cell: (15e12 * pre["weights"][cell] + 3.75e12 * mid["weights"][cell]) / raw["sources"][cell]["tokens"]
        for cell in CELLS
    }


def test_the_file_is_the_published_mix(raw: dict) -> None:
    assert raw["provenance"] == {
        "repository": "marin-community/marin",
        "path": "experiments/grug/moe_hero_ep/harrier_mix_2026_08_18.json",
        "commit": "4da809fbf99e02da307e1870395817fa8c373b2e",
        "url": "https://github.com/marin-community/marin/blob/4da809fbf99e02da307e1870395817fa8c373b2e/"
        "experiments/grug/moe_hero_ep/harrier_mix_2026_08_18.json",
        "note": "candidate quality_technical, weights from harrier_mix_2026_08_17_1, store "
        "s3://marin-us-east-02a/marin/datakit/store_4d2e363d",
    }
    assert raw["tokenizer"] == "marin-community/marin-tokenizer"
    assert list(raw["sources"]) == CELLS
    for cell, source in raw["sources"].items():
        assert source["cells"] == f"domain={cell[:3]}/quality={cell[4]}"
    # Spot checks against the published file: the first, the smallest and the largest cell.
    tokens = {cell: source["tokens"] for cell, source in raw["sources"].items()}
    assert tokens["c00q0"] == 9_126_994_294 and tokens["c39q4"] == 99_165_829_357
    assert min(tokens.values()) == tokens["c22q0"] == 3_385_150
    assert max(tokens.values()) == tokens["c26q4"] == 676_090_234_529
    assert sum(tokens.values()) == 23_106_103_007_622  # 23.11T, as the store's description says
    pre, mid = raw["phases"]
    assert (pre["name"], pre["tokens"], mid["name"], mid["tokens"]) == (
        "pretraining",
        "15T",
        "midtraining",
        "3.75T",
    )
    assert pre["weights"]["c30q4"] == 0.04759503480043832 and mid["weights"]["c32q3"] == 0.040449415611640636
    assert (
        pre["weights"]["c22q0"] == 9.587165281576292e-09 and mid["weights"]["c08q0"] == 2.1800781479305936e-07
    )
    for phase in (pre, mid):
        assert list(phase["weights"]) == CELLS
        assert math.fsum(phase["weights"].values()) == pytest.approx(1.0, abs=1e-12)
    assert (raw["total_tokens"], raw["total_steps"], raw["max_epochs"]) == ("18.75T", 390_251, 8)
    assert (raw["sequence_length"], raw["batch_size"], raw["block_size"]) == (4096, 11_264, 49_152)


def test_the_eight_epoch_cap_holds_at_the_budget(raw: dict) -> None:
    epochs = budget_epochs(raw)
    top = max(epochs, key=epochs.get)
    assert top == "c12q4" and epochs[top] == pytest.approx(2.0931, abs=1e-4)  # "stays at 2.09 epochs"
    assert all(value <= 8 for value in epochs.values())


def test_plan_is_390251_steps_with_midtraining_from_312192(hero_plan) -> None:
    plan = hero_plan
    assert plan.total_steps == 390_251 and plan.total_steps_given
    assert plan.tokens_per_step == 11_264 * 4096 == 46_137_344
    assert plan.planned_tokens == 390_251 * 46_137_344 == 18_005_144_633_344
    assert plan.total_tokens == 18_750_000_000_000
    # Steps of 11,264 sequences meet blocks of 49,152 every lcm / 11,264 = 48 steps.
    assert plan.block_steps == math.lcm(11_264, 49_152) // 11_264 == 48
    pre, mid = plan.phases
    # 80% of the steps, 312,200.8, down to a whole step and to a block boundary: Marin's _phase_1_start_step.
    assert pre.end_step == mid.start_step == int(0.8 * 390_251) // 48 * 48 == 312_192
    assert mid.end_step == 390_251
    assert pre.blocks * 49_152 == 312_192 * 11_264 and pre.partial_block_sequences == 0
    assert mid.blocks * 49_152 + mid.partial_block_sequences == 78_059 * 11_264
    assert mid.partial_block_sequences == 25_600
    assert (pre.tokens_requested, mid.tokens_requested) == (15 * 10**12, 3_750 * 10**9)
    for phase in plan.phases:
        assert sum(source.tokens for source in phase.sources) == phase.tokens
        assert sum(source.block_sequences for source in phase.sources) == 49_152


def test_each_cell_draws_its_blocks_and_repeats_as_the_run_does(raw: dict, hero_plan) -> None:
    pre, mid = hero_plan.phases
    # c30q4 in pretraining: its weight x 49,152 sequences = 2,339.4 -> 2,339 or 2,340 a block.
    c30 = pre.source("c30q4")
    assert c30.block_sequences in (2_339, 2_340)
    assert c30.tokens == c30.block_sequences * pre.blocks * 4096
    # In the partial block each cell draws its share of 25,600 sequences, within one sequence.
    c32 = mid.source("c32q3")
    partial = c32.tokens // 4096 - c32.block_sequences * mid.blocks
    assert abs(partial - Fraction(c32.block_sequences * 25_600, 49_152)) < 1
    # Over the run, each large cell repeats about 96.03% as often as at the budget (18.005T of 18.75T).
    share = 18_005_144_633_344 / 18.75e12
    epochs = budget_epochs(raw)
    for cell, total in hero_plan.sources.items():
        assert total.epochs <= 8
        if total.tokens > 100e9:
            assert total.epochs == pytest.approx(share * epochs[cell], rel=0.01), cell


@pytest.mark.parametrize("rung", sorted(LADDER))
def test_ladder_slices_are_simulated_epoching_of_the_budget(rung: str, hero_plan) -> None:
    racks, steps = LADDER[rung]
    spec = load_mixture(REPO / "mixtures" / f"marin-ladder-{rung}.yaml")
    assert spec.slice is not None and spec.slice.of == "marin-535b-a23b"
    plan = plan_mixture(spec)
    batch = racks * 1024
    assert (plan.total_steps, plan.batch_size, plan.block_size) == (steps, batch, 49_152)
    assert plan.planned_tokens == plan.total_tokens == steps * batch * 4096
    assert plan.slice.fraction == steps * batch * 4096 / 18.75e12
    multiple = 49_152 // math.gcd(49_152, batch)
    assert plan.phases[0].end_step == int(0.8 * steps) // multiple * multiple
    # Each cell repeats as often as at the budget: 1 / 0.9603 times as often as in the hero, which trains
    # 18.005T on the raw mixture (the same sequences per block, so block rounding cancels out).
    share = hero_plan.planned_tokens / hero_plan.total_tokens
    for cell, total in plan.sources.items():
        if total.tokens_available > 2e9:  # enough tokens for a slice's whole sequences not to matter
            assert total.epochs == pytest.approx(hero_plan.sources[cell].epochs / share, rel=0.02), cell


def test_mixture_plan_command_shows_the_run(capsys: pytest.CaptureFixture) -> None:
    assert main(["mixture", "plan", str(HERO)]) == 0
    out = capsys.readouterr().out
    assert "390,251 steps" in out and "phase midtraining: steps 312,192 to 390,251" in out
    assert main(["mixture", "check", *sorted(str(p) for p in (REPO / "mixtures").glob("*.yaml"))]) == 0
    assert capsys.readouterr().out.count(": ok (") == len(list((REPO / "mixtures").glob("*.yaml")))
