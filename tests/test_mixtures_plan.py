"""The planner: figures worked out by hand, max_epochs, shortfall, simulated epoching, runs given in steps
(partial last blocks), demo, diff. The hand-worked figures use an illustrative 11-source fixture; the
reference run's own 200-cell mixture is tests/test_marin_mixture.py's."""

from __future__ import annotations

import time
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.mixtures import (
    MixtureError,
    block_counts,
    diff_plans,
    load_mixture,
    load_mixture_text,
    plan_mixture,
)
from tokenmill.mixtures.plan import _water_fill

REPO = Path(__file__).resolve().parents[1]
MIXTURES = REPO / "mixtures"
REFERENCE = Path(__file__).parent / "fixtures" / "eleven-sources.yaml"
RUNGS = (48, 128, 381, 926)  # billions of tokens: slices of REFERENCE


def rung_of(billions: int, batch_size: int = 256) -> str:
    """A slice of REFERENCE, as a spec text read from REFERENCE's folder."""
    return (
        f"name: eleven-{billions}b\nslice_of: eleven-sources.yaml\ntotal_tokens: {billions}B\n"
        f"batch_size: {batch_size}\n"
    )


def counts_of(cells: dict[str, int], tokenizer: str = "tokenmill-bpe-8k") -> dict:
    return {
        "format_version": 1,
        "tokenizer": {"name": tokenizer, "sha256": "", "vocab_size": 8192},
        "total_tokens": sum(cells.values()),
        "total_documents": 0,
        "cells": {
            cell: {"tokens": tokens, "documents": 1, "manifest": f"{cell}/manifest.json"}
            for cell, tokens in cells.items()
        },
    }


# -- the 11-source fixture, by hand -------------------------------------------------------------------------
#
# 4,096 tokens x 8,192 sequences = 33,554,432 tokens per step; blocks of 2,048 sequences divide the batch,
# so boundaries may fall on any step (block_steps = 1) and each step holds 4 blocks.
#   pretraining asks 0.8 x 18.75T = 15T:  15e12 / 33,554,432 = 447,034.84 -> 447,035 steps
#     (33,554,432 x 447,034 = 14,999,971,954,688; the rest, 28,045,312, is 0.84 of a step: round up)
#   the run asks 18.75T: 18.75e12 / 33,554,432 = 558,793.54 -> 558,794 steps
#     (33,554,432 x 558,793 = 18,749,981,720,576; the rest, 18,279,424, is 0.54 of a step: round up)
#   midtraining: 558,794 - 447,035 = 111,759 steps, asked 3.75T.
# Blocks: 447,035 x 4 = 1,788,140 and 111,759 x 4 = 447,036. One sequence per block over a phase is
# 1,788,140 x 4,096 = 7,324,221,440 tokens (pretraining) and 447,036 x 4,096 = 1,831,059,456 (midtraining).
#
# Sequences per block, pretraining (weight x 2,048, floors sum to 2,042, the 6 largest remainders +1):
#   web-q4 327.68 -> 328, web-q3 491.52 -> 492, web-q2 450.56 -> 451, web-q1 163.84 -> 164,
#   code-hq 184.32 -> 184, code-lq 102.4 -> 102, math 61.44 -> 61, science 102.4 -> 102,
#   books 61.44 -> 61, wiki 20.48 -> 21, forum 81.92 -> 82   (remainders .92 .84 .68 .56 .52 .48 win)
# Midtraining (floors sum to 2,044, 4 largest remainders +1: science .8, math .76, code-hq .6, wiki .44):
#   web-q4 614.4 -> 614, web-q3 307.2 -> 307, code-hq 409.6 -> 410, math 245.76 -> 246,
#   science 204.8 -> 205, books 102.4 -> 102, wiki 61.44 -> 62, forum 102.4 -> 102
PRE_SEQ_TOKENS = 1_788_140 * 4096
MID_SEQ_TOKENS = 447_036 * 4096
PRE_BLOCK = {
    "web-q4": 328,
    "web-q3": 492,
    "web-q2": 451,
    "web-q1": 164,
    "code-hq": 184,
    "code-lq": 102,
    "math": 61,
    "science": 102,
    "books": 61,
    "wiki": 21,
    "forum": 82,
}
MID_BLOCK = {
    "web-q4": 614,
    "web-q3": 307,
    "code-hq": 410,
    "math": 246,
    "science": 205,
    "books": 102,
    "wiki": 62,
    "forum": 102,
}


@pytest.fixture(scope="module")
def reference_plan():
    return plan_mixture(load_mixture(REFERENCE))


def test_reference_phase_budgets_and_boundaries(reference_plan):
    plan = reference_plan
    assert plan.tokens_per_step == 33_554_432 and plan.block_steps == 1
    pre, mid = plan.phases
    assert (pre.tokens_requested, mid.tokens_requested) == (15 * 10**12, 3_750 * 10**9)
    assert (pre.start_step, pre.end_step, pre.steps) == (0, 447_035, 447_035)
    assert (mid.start_step, mid.end_step, mid.steps) == (447_035, 558_794, 111_759)
    assert (pre.blocks, mid.blocks) == (1_788_140, 447_036)
    assert pre.tokens == 447_035 * 33_554_432 == 15_000_005_509_120
    assert mid.tokens == 111_759 * 33_554_432 == 3_750_009_765_888
    assert plan.total_steps == 558_794


def test_reference_per_block_counts_and_tokens(reference_plan):
    pre, mid = reference_plan.phases
    assert {s.name: s.block_sequences for s in pre.sources} == PRE_BLOCK
    assert {s.name: s.block_sequences for s in mid.sources} == MID_BLOCK
    assert sum(PRE_BLOCK.values()) == sum(MID_BLOCK.values()) == 2048
    # web-q4 in pretraining: 328 x 7,324,221,440 = 2,402,344,632,320 tokens of the declared 1.2T.
    web = pre.source("web-q4")
    assert web.tokens == 2_402_344_632_320
    assert web.epochs == pytest.approx(2_402_344_632_320 / 1.2e12)  # 2.0020
    assert web.weight == 328 / 2048 and web.weight_requested == 0.16
    assert sum(s.tokens for s in pre.sources) == pre.tokens


def test_reference_epochs_over_the_run(reference_plan):
    totals = reference_plan.sources
    # math: 61 x 7,324,221,440 + 246 x 1,831,059,456 = 446,777,507,840 + 450,440,626,176 tokens of 180B
    assert totals["math"].tokens == 897_218_134_016
    assert totals["math"].epochs == pytest.approx(4.98454519)
    # code-hq: 184 x 7,324,221,440 + 410 x 1,831,059,456 = 2,098,391,121,920 of 600B: 3.497 epochs (max 4)
    assert totals["code-hq"].tokens == 2_098_391_121_920
    assert totals["code-hq"].epochs == pytest.approx(3.49731854)
    # web-q4: (328 x 7,324,221,440) + (614 x 1,831,059,456) of 1.2T
    assert totals["web-q4"].epochs == pytest.approx((328 * PRE_SEQ_TOKENS + 614 * MID_SEQ_TOKENS) / 1.2e12)
    for total in totals.values():
        assert total.epochs <= total.max_epochs
    assert reference_plan.illustrative and reference_plan.tokens_from == "declared"


# -- rounding to whole blocks when a block spans several steps ---------------------------------------------


def test_rung_48b_boundaries_are_whole_blocks():
    plan = plan_mixture(load_mixture_text(rung_of(48), str(REFERENCE.with_name("eleven-48b.yaml"))))
    # 256 sequences a step, blocks of 2,048: lcm 2,048 sequences = 8 steps = 8,388,608 tokens.
    # pretraining asks 0.8 x 48B = 38.4B = 4,577.64 granules -> 4,578 -> step 36,624
    # the run asks 48B = 5,722.05 granules -> 5,722 -> step 45,776
    assert plan.block_steps == 8
    pre, mid = plan.phases
    assert (pre.start_step, pre.end_step, mid.end_step) == (0, 36_624, 45_776)
    assert (pre.blocks, mid.blocks) == (4_578, 1_144)
    assert all(phase.end_step % 8 == 0 for phase in plan.phases)


SMALL = """\
name: small
tokenizer: tok
total_tokens: 10K
sequence_length: 100
batch_size: 3
block_size: 4
sources:
  web: {cells: domain=web/*, tokens: 100K}
  code: {cells: domain=code/*, tokens: 100K}
phases:
  - name: a
    share: 0.8
    weights: {web: 0.6, code: 0.4}
  - name: b
    share: 0.2
    weights: {web: 0.6, code: 0.4}
"""


def test_block_that_does_not_divide_the_batch():
    plan = plan_mixture(load_mixture_text(SMALL))
    # 300 tokens a step; lcm(3, 4) = 12 sequences = 4 steps = 1,200 tokens per granule.
    # a: 8,000 / 1,200 = 6.67 -> 7 granules -> step 28; run: 10,000 / 1,200 = 8.33 -> 8 -> step 32.
    assert plan.block_steps == 4
    a, b = plan.phases
    assert (a.end_step, b.start_step, b.end_step) == (28, 28, 32)
    assert (a.blocks, b.blocks) == (21, 3)  # 28 x 3 / 4 and 4 x 3 / 4
    # 0.6 x 4 = 2.4 and 0.4 x 4 = 1.6: floors 2 and 1, the remainder goes to code (.6 > .4).
    assert (a.source("web").block_sequences, a.source("code").block_sequences) == (2, 2)
    assert a.source("web").tokens == 2 * 21 * 100
    # the realized weight (0.5 for 0.6) is far off: the plan says so.
    assert any("becomes 2/4 = 0.5 per block" in warning for warning in plan.warnings)


def test_phase_too_small_for_a_block():
    text = SMALL.replace("share: 0.8", "share: 0.99").replace("share: 0.2", "share: 0.01")
    with pytest.raises(MixtureError) as caught:
        plan_mixture(load_mixture_text(text))
    assert str(caught.value) == (
        "phases[1]: 100 tokens round to no steps: phase boundaries fall on whole mixture blocks, here "
        "4 step(s) of 300 tokens; give the phase more tokens or use a smaller block_size or batch_size "
        "(line 14)"
    )


# -- a run given in steps (total_steps): the budget stays, the steps are the run -----------------------------

STEPPED = """\
name: stepped
tokenizer: tok
total_tokens: 10K
total_steps: 7
sequence_length: 100
batch_size: 3
block_size: 4
sources:
  web: {cells: domain=web/*, tokens: 100K}
  code: {cells: domain=code/*, tokens: 100K}
phases:
  - name: a
    share: 0.8
    weights: {web: 0.6, code: 0.4}
  - name: b
    share: 0.2
    weights: {web: 0.5, code: 0.5}
"""


def test_total_steps_is_the_run_and_total_tokens_the_budget():
    plan = plan_mixture(load_mixture_text(STEPPED))
    # 300 tokens a step, granules of lcm(3, 4) = 12 sequences = 4 steps. The run is 7 steps, 2,100 tokens of
    # the 10K budget; a ends at floor(0.8 x 7) = 5, down to a granule: 4. b: steps 4-7, 9 sequences = 2
    # blocks and 1 sequence of a third.
    assert (plan.total_steps, plan.planned_tokens, plan.total_tokens) == (7, 2_100, 10_000)
    assert plan.total_steps_given and plan.to_json()["total_steps_given"] is True
    a, b = plan.phases
    assert (a.start_step, a.end_step, b.start_step, b.end_step) == (0, 4, 4, 7)
    assert (a.blocks, a.partial_block_sequences, b.blocks, b.partial_block_sequences) == (3, 0, 2, 1)
    assert (a.tokens_requested, b.tokens_requested) == (8_000, 2_000)  # shares of the budget
    # a: 2.4 / 1.6 -> 2 and 2 a block, 3 blocks. b: 2 and 2, 2 blocks, and the partial block's one sequence
    # goes by largest remainder of (2, 2) over 1: a tie, to the first source.
    assert (a.source("web").tokens, a.source("code").tokens) == (600, 600)
    assert (b.source("web").tokens, b.source("code").tokens) == (500, 400)
    for phase in plan.phases:
        assert sum(source.tokens for source in phase.sources) == phase.tokens == phase.steps * 300


def test_total_steps_boundaries_round_down_to_a_granule():
    # 0.8 x 14 = 11.2 steps: floored to step 11, then down to the granule at 8 (half up would say 12).
    plan = plan_mixture(load_mixture_text(STEPPED.replace("total_steps: 7", "total_steps: 14")))
    assert [phase.end_step for phase in plan.phases] == [8, 14]
    # A budget without steps rounds half up on granules as before: 8,000 tokens / 1,200 = 6.67 -> step 28.
    plain = plan_mixture(load_mixture_text(STEPPED.replace("total_steps: 7\n", "")))
    assert [phase.end_step for phase in plain.phases] == [28, 32] and not plain.total_steps_given


def test_total_steps_alone_sets_the_budget(tmp_path):
    alone = plan_mixture(load_mixture_text(STEPPED.replace("total_tokens: 10K\n", "")))
    assert alone.total_tokens == alone.planned_tokens == 2_100
    # A slice of 3 steps of 1 sequence: blocks of 4 sequences span 4 steps, and the first phase would end
    # at floor(0.8 x 3) = 2, down to step 0: no room for it, and the error says so.
    (tmp_path / "stepped.yaml").write_text(STEPPED)
    small = "name: small\nslice_of: stepped.yaml\ntotal_steps: 3\nbatch_size: 1\n"
    with pytest.raises(MixtureError, match="phases\\[0\\]: 240 tokens round to no steps"):
        plan_mixture(load_mixture_text(small, str(tmp_path / "small.yaml")))


def test_total_steps_slice(tmp_path):
    (tmp_path / "stepped.yaml").write_text(STEPPED.replace("total_steps: 7", "total_steps: 20"))
    text = "name: small\nslice_of: stepped.yaml\ntotal_steps: 9\n"
    plan = plan_mixture(load_mixture_text(text, str(tmp_path / "small.yaml")))
    # 9 steps x 3 x 100 = 2,700 tokens of the parent's 10K budget: every source scaled to 27%.
    assert (plan.total_tokens, plan.planned_tokens, plan.total_steps) == (2_700, 2_700, 9)
    assert plan.slice.fraction == pytest.approx(0.27)
    assert plan.sources["web"].tokens_available == 27_000
    assert [phase.end_step for phase in plan.phases] == [4, 9]  # floor(7.2) = 7, down to 4


def test_a_run_needs_total_tokens_or_total_steps(tmp_path):
    with pytest.raises(MixtureError) as caught:
        load_mixture_text(STEPPED.replace("total_tokens: 10K\n", "").replace("total_steps: 7\n", ""))
    assert str(caught.value) == "total_tokens: required field missing (or give total_steps) (line 1)"
    (tmp_path / "stepped.yaml").write_text(STEPPED)
    with pytest.raises(MixtureError, match="total_tokens: required field missing"):
        load_mixture_text("name: s\nslice_of: stepped.yaml\n", str(tmp_path / "s.yaml"))
    with pytest.raises(MixtureError, match="total_steps: a slice takes between 1 token"):
        load_mixture_text("name: s\nslice_of: stepped.yaml\ntotal_steps: 100\n", str(tmp_path / "s.yaml"))


def test_redistribute_counts_a_partial_block_whole():
    # 9 sequences: 2 blocks of 4 and 1 sequence. web may give 400 tokens (4 sequences): at 2 a block it
    # would draw 4 in the whole blocks and possibly 1 more in the partial one, so its cap is 1 a block.
    text = STEPPED.replace("total_steps: 7", "total_steps: 3").replace(
        "web: {cells: domain=web/*, tokens: 100K}", "web: {cells: domain=web/*, tokens: 400}"
    )
    text = text.replace("share: 0.8", "share: 0.99").replace("share: 0.2", "share: 0.01")
    text = text.replace("  - name: b\n    share: 0.01\n    weights: {web: 0.5, code: 0.5}\n", "")
    text = text.replace("share: 0.99", "share: 1") + "shortfall: redistribute\n"
    plan = plan_mixture(load_mixture_text(text))
    assert plan.sources["web"].tokens <= 400 and plan.phases[0].partial_block_sequences == 1
    assert sum(source.tokens for source in plan.phases[0].sources) == 900


def test_provenance_is_checked_and_carried():
    text = STEPPED + "provenance: {repository: a/b, path: c.json, commit: 4da809f}\n"
    plan = plan_mixture(load_mixture_text(text))
    assert plan.to_json()["provenance"] == {"repository": "a/b", "path": "c.json", "commit": "4da809f"}
    with pytest.raises(MixtureError, match="provenance.commit"):
        load_mixture_text(STEPPED + "provenance: {repository: a/b, path: c.json, commit: main}\n")


# -- max_epochs and the shortfall policy -------------------------------------------------------------------

CAPPED = """\
name: capped
tokenizer: tok
total_tokens: 1M
sequence_length: 100
batch_size: 10
sources:
  web: {cells: domain=web/*, tokens: 500K}
  code: {cells: domain=code/*, tokens: 10M}
phases:
  - name: pretraining
    share: 0.8
    weights: {web: 0.6, code: 0.4}
  - name: midtraining
    share: 0.2
    weights: {web: 0.5, code: 0.5}
"""


def test_source_over_max_epochs_is_an_error_with_the_numbers():
    # 1,000 tokens a step, block = batch = 10 sequences: pretraining 800 blocks, 80,000 tokens per
    # sequence-per-block; midtraining 200 blocks, 20,000. web: 6 x 80,000 + 5 x 20,000 = 580,000 > 500,000.
    with pytest.raises(MixtureError) as caught:
        plan_mixture(load_mixture_text(CAPPED))
    assert str(caught.value) == (
        "sources.web: needs 580K tokens (pretraining 480K, midtraining 100K) = 1.16 epochs of its 500K; "
        "max_epochs 1 allows 500K (raise max_epochs, lower its weights, or set shortfall: redistribute) "
        "(line 7)"
    )


def test_max_epochs_per_source_lifts_the_cap():
    text = CAPPED.replace("tokens: 500K}", "tokens: 500K, max_epochs: 1.2}")
    plan = plan_mixture(load_mixture_text(text))
    assert plan.sources["web"].tokens == 580_000 and plan.sources["web"].epochs == pytest.approx(1.16)


def test_shortfall_redistribute_spreads_the_rest_by_weight():
    plan = plan_mixture(load_mixture_text(CAPPED + "shortfall: redistribute\n"))
    pre, mid = plan.phases
    # pretraining fits (6 x 80,000 = 480,000 <= 500,000); midtraining has 20,000 left = 1 sequence per block.
    assert (pre.source("web").block_sequences, pre.source("code").block_sequences) == (6, 4)
    assert (mid.source("web").block_sequences, mid.source("code").block_sequences) == (1, 9)
    assert plan.sources["web"].tokens == 500_000 and plan.sources["web"].epochs == 1.0
    assert mid.tokens == sum(source.tokens for source in mid.sources)
    assert any(
        "web at max_epochs; 80K tokens went to the other sources by weight" in w for w in plan.warnings
    )


def test_shortfall_redistribute_fails_when_everything_is_exhausted():
    # pretraining: caps 500K // 80K = 6 (web) and 300K // 80K = 3 (code) sequences per block: 9 of 10.
    # midtraining: web has 20K left (1 per block), code 60K (3 per block): 4 of 10.
    text = CAPPED.replace("tokens: 10M}", "tokens: 300K}") + "shortfall: redistribute\n"
    with pytest.raises(MixtureError) as caught:
        plan_mixture(load_mixture_text(text))
    assert str(caught.value) == (
        "phases[0]: not enough tokens even with shortfall: redistribute: within max_epochs its sources can "
        "give 720K tokens, the phase needs 800K (line 10); "
        "phases[1]: not enough tokens even with shortfall: redistribute: within max_epochs its sources can "
        "give 80K tokens, the phase needs 200K (line 13)"
    )


# -- simulated epoching ------------------------------------------------------------------------------------

REFERENCE_CELLS = {
    f"domain={domain}/quality={q}": tokens // 5
    for domain, tokens in {
        "web": 21_300 * 10**9,
        "code": 1_500 * 10**9,
        "math": 300 * 10**9,
        "science": 600 * 10**9,
        "books": 300 * 10**9,
        "wiki": 60 * 10**9,
        "forum": 400 * 10**9,
    }.items()
    for q in range(5)
}


@pytest.mark.parametrize(
    "counts", [None, counts_of(REFERENCE_CELLS, "marin-tokenizer-128k")], ids=["declared", "counted"]
)
@pytest.mark.parametrize("rung", RUNGS)
def test_rungs_repeat_each_source_as_often_as_the_full_run(rung, counts):
    full = plan_mixture(load_mixture(REFERENCE), counts)
    small = plan_mixture(load_mixture_text(rung_of(rung), str(REFERENCE.with_name("rung.yaml"))), counts)
    assert small.total_tokens == rung * 10**9
    assert small.slice.of == "eleven-sources"
    assert small.slice.fraction == pytest.approx(rung * 10**9 / 18.75e12)
    for big_phase, small_phase in zip(full.phases, small.phases, strict=True):
        assert small_phase.name == big_phase.name
        assert small_phase.tokens == pytest.approx(big_phase.tokens * small.slice.fraction, rel=1e-3)
        for big, little in zip(big_phase.sources, small_phase.sources, strict=True):
            assert little.block_sequences == big.block_sequences
            assert little.epochs == pytest.approx(big.epochs, rel=2e-3), (small_phase.name, big.name)
    for name, total in full.sources.items():
        assert small.sources[name].epochs == pytest.approx(total.epochs, rel=2e-3)
        assert small.sources[name].tokens_available_full == total.tokens_available


def test_plain_small_run_is_not_a_slice():
    # The same 48B run without slice_of would see each source a tiny fraction of one epoch.
    text = REFERENCE.read_text().replace("total_tokens: 18.75T", "total_tokens: 48B")
    plan = plan_mixture(load_mixture_text(text))
    assert plan.sources["math"].epochs < 0.02


# -- the demo and counts.json ------------------------------------------------------------------------------

SAMPLE_MIXTURE = Path(__file__).parent / "fixtures" / "sample-mixture.yaml"
SAMPLE_CELLS = {
    **{f"domain=web/quality={q}": tokens for q, tokens in enumerate([90_000, 60_000, 40_000, 25_000, 8_000])},
    **{f"domain=code/quality={q}": tokens for q, tokens in enumerate([20_000, 30_000, 12_000])},
}


def test_demo_plans_against_a_sample_catalog():
    plan = plan_mixture(load_mixture(SAMPLE_MIXTURE), counts_of(SAMPLE_CELLS))
    assert plan.tokens_from == "counts.json" and not plan.illustrative
    assert plan.tokens_per_step == 1024 and plan.block_steps == 8
    pre, mid = plan.phases
    assert (pre.end_step, mid.end_step) == (1560, 1952)  # 1.6M / 8,192 = 195.3 blocks; 2M / 8,192 = 244.1
    assert pre.source("domain=web/*").cells == [f"domain=web/quality={q}" for q in range(5)]
    assert pre.source("domain=web/*").tokens_available == 223_000
    # no math cells in this sample: math's weight went to web and code, and the plan says so.
    assert pre.source("domain=math/*").tokens == 0
    assert any("domain=math/* matches no cell in counts.json" in warning for warning in plan.warnings)
    for phase in plan.phases:
        assert sum(source.tokens for source in phase.sources) == phase.tokens
    assert plan.cells["domain=web/quality=4"].tokens_available == 8_000
    assert sum(cell.tokens for cell in plan.cells.values()) == pytest.approx(plan.planned_tokens, abs=10)


def test_demo_plans_with_web_only():
    cells = {cell: tokens for cell, tokens in SAMPLE_CELLS.items() if "web" in cell}
    plan = plan_mixture(load_mixture(SAMPLE_MIXTURE), counts_of(cells))
    assert plan.phases[0].source("domain=web/*").block_sequences == 64


def test_demo_without_counts_needs_them():
    with pytest.raises(MixtureError) as caught:
        plan_mixture(load_mixture(SAMPLE_MIXTURE))
    assert str(caught.value) == (
        "phases[0].weights.domain=web/*: no declared tokens, and no tokens/counts.json to count its cells "
        "(and 4 more sources): plan with --counts (line 25)"
    )


def test_tokenizer_mismatch_is_a_warning():
    plan = plan_mixture(load_mixture(SAMPLE_MIXTURE), counts_of(SAMPLE_CELLS, tokenizer="other"))
    assert any(w.startswith("tokenizer: the mixture names 'tokenmill-bpe-8k'") for w in plan.warnings)


def test_overlapping_sources_in_a_phase_are_a_warning():
    text = SMALL.replace(
        "weights: {web: 0.6, code: 0.4}\n  - name: b", "weights: {web: 0.6, quality>=3: 0.4}\n  - name: b"
    )
    cells = {"domain=web/quality=3": 50_000, "domain=web/quality=4": 50_000, "domain=code/quality=4": 50_000}
    plan = plan_mixture(load_mixture_text(text), counts_of(cells))
    assert any(
        "drawn by more than one source: domain=web/quality=3 (web, quality>=3)" in w for w in plan.warnings
    )


def test_bad_counts_file():
    with pytest.raises(MixtureError) as caught:
        plan_mixture(
            load_mixture_text(SMALL), {"format_version": 1, "cells": {"domain=web/quality=1": {"tokens": -1}}}
        )
    assert (
        str(caught.value)
        == "counts.json: cells.domain=web/quality=1.tokens: expected a whole number >= 0, got -1"
    )


# -- the JSON shape ----------------------------------------------------------------------------------------


def test_plan_json_has_the_documented_shape(reference_plan):
    document = reference_plan.to_json()
    for key in (
        "name",
        "tokenizer",
        "total_tokens",
        "sequence_length",
        "batch_size",
        "block_size",
        "tokens_per_step",
        "phases",
    ):
        assert key in document
    phase = document["phases"][0]
    assert {"name", "tokens", "steps", "start_step", "end_step", "sources"} <= set(phase)
    source = phase["sources"][0]
    assert {"name", "cells", "weight", "tokens", "tokens_available", "epochs"} <= set(source)
    assert source["cells"] == ["domain=web/quality=4"]
    assert document["phases"][1]["start_step"] == phase["end_step"]
    import json

    json.dumps(document)


# -- apportionment properties ------------------------------------------------------------------------------

weights_strategy = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=40).filter(any)


@settings(max_examples=200, deadline=None)
@given(weights=weights_strategy, block=st.integers(min_value=1, max_value=5000))
def test_block_counts_sum_to_the_block_and_stay_within_one(weights, block):
    counts = block_counts(weights, block)
    assert sum(counts) == block
    total = sum(weights)
    for weight, count in zip(weights, counts, strict=True):
        quota = Fraction(weight * block, total)
        assert quota - 1 < count < quota + 1
        if weight == 0:
            assert count == 0


@settings(max_examples=200, deadline=None)
@given(
    weights=weights_strategy,
    caps=st.lists(st.integers(min_value=0, max_value=300), min_size=40, max_size=40),
    block=st.integers(min_value=1, max_value=1000),
)
def test_water_fill_respects_caps_and_fills_when_it_can(weights, caps, block):
    names = [f"s{i}" for i in range(len(weights))]
    positive = {n: Fraction(w) for n, w in zip(names, weights, strict=True) if w > 0}
    cap = dict(zip(names, caps, strict=False))
    counts, unplaced = _water_fill(positive, cap, block)
    assert all(counts[n] <= cap[n] for n in positive)
    capacity = sum(cap[n] for n in positive)
    assert unplaced == max(0, block - capacity)
    assert sum(counts.values()) == block - unplaced


# -- diff --------------------------------------------------------------------------------------------------


def test_diff_shows_tokens_and_epochs_per_source_and_phase(reference_plan):
    text = REFERENCE.read_text().replace(
        "      math: 0.12\n      science: 0.10\n", "      math: 0.14\n      science: 0.08\n"
    )
    changed = plan_mixture(load_mixture_text(text, str(REFERENCE)))
    result = diff_plans(reference_plan, changed)
    assert result["fields"] == {}
    [phase] = result["phases"]
    assert phase["name"] == "midtraining" and phase["changes"] == {}
    by_name = {source["name"]: source for source in phase["sources"]}
    assert set(by_name) == {"math", "science"}
    # math 0.14 x 2,048 = 286.72 -> 287 sequences per block (was 246)
    assert by_name["math"]["changes"]["block_sequences"] == [246, 287]
    assert by_name["math"]["changes"]["tokens"] == [246 * MID_SEQ_TOKENS, 287 * MID_SEQ_TOKENS]
    assert by_name["math"]["changes"]["epochs"][1] > by_name["math"]["changes"]["epochs"][0]
    assert {source["name"] for source in result["sources"]} == {"math", "science"}


def test_diff_of_a_plan_with_itself_is_empty(reference_plan):
    assert diff_plans(reference_plan, reference_plan) == {
        "a": "eleven-sources",
        "b": "eleven-sources",
        "fields": {},
        "phases": [],
        "sources": [],
    }


# -- speed -------------------------------------------------------------------------------------------------


def test_two_hundred_cells_plan_quickly(tmp_path):
    # bench/mixture_plan.py measures this properly; here only a generous guard against a regression.
    domains = [f"d{i:02d}" for i in range(40)]
    cells = {f"domain={d}/quality={q}": 10**11 * (1 + q) for d in domains for q in range(5)}
    weights = "\n".join(f"      domain={d}/quality={q}: 0.005" for d in domains for q in range(5))
    text = (
        "name: wide\ntokenizer: tok\ntotal_tokens: 18.75T\nsequence_length: 4096\nbatch_size: 8192\n"
        "block_size: 2048\nmax_epochs: 100\nphases:\n"
        f"  - name: pretraining\n    share: 0.8\n    weights:\n{weights}\n"
        f"  - name: midtraining\n    share: 0.2\n    weights:\n{weights}\n"
    )
    started = time.perf_counter()
    plan = plan_mixture(load_mixture_text(text), counts_of(cells))
    assert time.perf_counter() - started < 5
    assert len(plan.sources) == 200 and len(plan.phases[0].sources) == 200


def test_a_cell_drawn_by_two_sources_over_their_cap_is_a_warning():
    # Only web q0 exists: domain=web/* takes all of pretraining, domain=web/quality<=2 all of midtraining;
    # each stays under max_epochs 100, but the one cell they share is drawn about 105 times.
    plan = plan_mixture(load_mixture(SAMPLE_MIXTURE), counts_of({"domain=web/quality=0": 19_000}))
    assert plan.sources["domain=web/*"].epochs < 100 and plan.sources["domain=web/quality<=2"].epochs < 100
    assert plan.cells["domain=web/quality=0"].epochs == pytest.approx(
        plan.sources["domain=web/*"].epochs + plan.sources["domain=web/quality<=2"].epochs
    )
    assert any(
        w.startswith(
            "cells drawn by several sources repeat more than their max_epochs: domain=web/quality=0 105."
        )
        for w in plan.warnings
    )


def test_plan_carries_the_tokenizer_hash_of_the_counts():
    counts = counts_of(SAMPLE_CELLS)
    counts["tokenizer"]["sha256"] = "ab" * 32
    plan = plan_mixture(load_mixture(SAMPLE_MIXTURE), counts)
    assert plan.to_json()["tokenizer_sha256"] == "ab" * 32
    assert plan_mixture(load_mixture(REFERENCE)).to_json()["tokenizer_sha256"] is None
