"""Mixture specs: the schema, the YAML rules and the exact error for each kind of mistake."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tokenmill.mixtures import (
    MixtureError,
    load_mixture,
    load_mixture_text,
    mixture_json_schema,
    plan_mixture,
)
from tokenmill.mixtures.selectors import parse_selector

REPO = Path(__file__).resolve().parents[1]
MIXTURES = REPO / "mixtures"

# Line numbers matter below: the bad cases edit this text and check the line each error names.
BASE = """\
name: t
tokenizer: tok
total_tokens: 1M
sequence_length: 100
batch_size: 10
sources:
  web: {cells: domain=web/*, tokens: 10M}
  code: {cells: domain=code/*, tokens: 10M}
phases:
  - name: pretraining
    share: 0.8
    weights:
      web: 0.6
      code: 0.4
  - name: midtraining
    share: 0.2
    weights:
      web: 0.5
      code: 0.5
"""


def load(text: str, tmp_path: Path, name: str = "t.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_mixture(path)


def error_of(text: str, tmp_path: Path, plan: bool = False, counts: dict | None = None) -> str:
    with pytest.raises(MixtureError) as caught:
        mixture = load(text, tmp_path)
        if plan:
            plan_mixture(mixture, counts)
    return str(caught.value)


def edit(old: str, new: str) -> str:
    assert old in BASE
    return BASE.replace(old, new, 1)


def test_base_is_valid(tmp_path):
    mixture = load(BASE, tmp_path)
    assert mixture.total_tokens == 1_000_000
    assert [phase.name for phase in mixture.phases] == ["pretraining", "midtraining"]
    assert mixture.block_size == 10  # defaults to the batch size
    assert mixture.shortfall == "error" and mixture.max_epochs == 1.0


# -- the bad cases of the issue, each with its exact message ---------------------------------------------


def test_weights_that_do_not_sum_to_one(tmp_path):
    text = edit("      code: 0.5\n", "      code: 0.4\n")
    assert error_of(text, tmp_path) == (
        "phases[1].weights: weights sum to 0.9, not 1 (set normalize: true to rescale them) (line 17)"
    )


def test_normalize_rescales_weights(tmp_path):
    text = edit(
        "    share: 0.2\n    weights:\n      web: 0.5\n      code: 0.5\n",
        "    share: 0.2\n    normalize: true\n    weights:\n      web: 3\n      code: 1\n",
    )
    mixture = load(text, tmp_path)
    assert mixture.phases[1].weights == {"web": 0.75, "code": 0.25}


def test_negative_weight(tmp_path):
    text = edit("      web: 0.6\n      code: 0.4\n", "      web: 1.4\n      code: -0.4\n")
    assert (
        error_of(text, tmp_path)
        == "phases[0].weights.code: negative weight -0.4; weights must be >= 0 (line 14)"
    )


def test_unknown_source(tmp_path):
    text = edit("      web: 0.5\n      code: 0.5\n", "      web: 0.5\n      code-q4: 0.5\n")
    assert error_of(text, tmp_path) == "phases[1].weights.code-q4: unknown source (line 19)"


def test_unknown_source_suggests_a_close_name(tmp_path):
    text = edit("      code: 0.4\n", "      cdoe: 0.4\n")
    assert error_of(text, tmp_path) == "phases[0].weights.cdoe: unknown source; did you mean code? (line 14)"


def test_phase_shares_that_do_not_sum_to_one(tmp_path):
    text = edit("    share: 0.2\n", "    share: 0.3\n")
    assert error_of(text, tmp_path) == "phases: phase shares sum to 1.1, not 1 (line 9)"


def test_phase_tokens_must_add_up_to_the_total(tmp_path):
    text = edit("    share: 0.8\n", "    tokens: 700K\n")
    assert error_of(text, tmp_path) == (
        "phases: phase budgets sum to 900K (900,000 tokens), but total_tokens is 1M (1,000,000) (line 9)"
    )


def test_phase_with_share_and_tokens(tmp_path):
    text = edit("    share: 0.8\n", "    share: 0.8\n    tokens: 800K\n")
    assert error_of(text, tmp_path) == "phases[0]: give share or tokens, not both (line 10)"


def test_weight_on_a_source_with_no_declared_tokens(tmp_path):
    text = edit("code: {cells: domain=code/*, tokens: 10M}", "code: {cells: domain=code/*, tokens: 0}")
    assert error_of(text, tmp_path, plan=True) == (
        "phases[0].weights.code: source has no tokens: declared tokens: 0 (line 14); "
        "phases[1].weights.code: source has no tokens: declared tokens: 0 (line 19)"
    )


def test_weight_on_a_pattern_that_matches_no_cell(tmp_path):
    counts = {"format_version": 1, "cells": {"domain=web/quality=3": {"tokens": 10_000_000}}}
    assert error_of(BASE, tmp_path, plan=True, counts=counts) == (
        "phases[0].weights.code: source has no tokens: domain=code/* matches no cell in counts.json "
        "(line 14); "
        "phases[1].weights.code: source has no tokens: domain=code/* matches no cell in counts.json (line 19)"
    )


def test_zero_weight_on_a_source_with_no_tokens_is_fine(tmp_path):
    text = edit("code: {cells: domain=code/*, tokens: 10M}", "code: {cells: domain=code/*, tokens: 0}")
    text = text.replace("      web: 0.6\n      code: 0.4\n", "      web: 1\n      code: 0\n")
    text = text.replace("      web: 0.5\n      code: 0.5\n", "      web: 1\n")
    plan = plan_mixture(load(text, tmp_path))
    assert plan.phases[0].source("code").tokens == 0


@pytest.mark.parametrize("bad", ["18.75X", "1.2.3T", "-5M", "lots", "1e400"])
def test_malformed_number(tmp_path, bad):
    message = error_of(edit("total_tokens: 1M", f"total_tokens: {bad}"), tmp_path)
    assert message.startswith("total_tokens: not a count: ")
    assert message.endswith("(line 3)")


def test_malformed_number_exact(tmp_path):
    assert error_of(edit("total_tokens: 1M", "total_tokens: 18.75X"), tmp_path) == (
        "total_tokens: not a count: '18.75X' (expected a number such as 18.75T, 926B, 48e9) (line 3)"
    )


def test_malformed_declared_count(tmp_path):
    text = edit("tokens: 10M}\n  code", "tokens: ten}\n  code")
    assert error_of(text, tmp_path) == (
        "sources.web.tokens: not a count: 'ten' (expected a number such as 18.75T, 926B, 48e9) (line 7)"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18.75T", 18_750_000_000_000),
        ("926B", 926 * 10**9),
        ("48e9", 48 * 10**9),
        ("1_000_000", 10**6),
        ("1.5e+6", 1_500_000),
    ],
)
def test_counts_accept_suffixes_and_exponents(tmp_path, text, expected):
    assert load(edit("total_tokens: 1M", f"total_tokens: {text}"), tmp_path).total_tokens == expected


def test_duplicated_key(tmp_path):
    text = edit("      web: 0.6\n      code: 0.4\n", "      web: 0.6\n      web: 0.4\n")
    assert error_of(text, tmp_path) == "phases[0].weights.web: duplicate key (first at line 13) (line 14)"


def test_duplicated_top_level_key(tmp_path):
    assert error_of(BASE + "name: again\n", tmp_path) == "name: duplicate key (first at line 1) (line 20)"


def test_yaml_tag_that_would_construct_an_object(tmp_path):
    marker = tmp_path / "pwned"
    text = edit("tokenizer: tok", f'tokenizer: !!python/object/apply:os.system ["touch {marker}"]')
    assert error_of(text, tmp_path) == (
        "tokenizer: YAML tag !!python/object/apply:os.system is not allowed: a mixture holds only mappings, "
        "lists, strings, numbers and booleans (line 2)"
    )
    assert not marker.exists()


@pytest.mark.parametrize("tag", ["!!python/name:os.system", "!!binary", "!custom", "!!set"])
def test_other_tags_are_refused(tmp_path, tag):
    message = error_of(edit("tokenizer: tok", f"tokenizer: {tag} x"), tmp_path)
    assert message.startswith("tokenizer: YAML tag ") and "is not allowed" in message


def test_tag_on_a_mapping_is_refused(tmp_path):
    text = edit("  web: {cells", "  web: !!python/object:builtins.dict {cells")
    assert error_of(text, tmp_path).startswith(
        "sources.web: YAML tag !!python/object:builtins.dict is not allowed"
    )


def test_alias_bomb_is_refused(tmp_path):
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i in range(1, 8):
        bomb += f"{chr(97 + i)}: &{chr(97 + i)} [" + ", ".join([f"*{chr(96 + i)}"] * 10) + "]\n"
    assert "alias bomb" in error_of(bomb, tmp_path)


def test_anchors_and_merge_keys_work(tmp_path):
    text = BASE.replace(
        "    weights:\n      web: 0.6\n      code: 0.4\n",
        "    weights: &pre\n      web: 0.6\n      code: 0.4\n",
    )
    text = text.replace(
        "    weights:\n      web: 0.5\n      code: 0.5\n", "    weights: {<<: *pre, web: 0.6}\n"
    )
    mixture = load(text, tmp_path)
    assert mixture.phases[1].weights == mixture.phases[0].weights


def test_invalid_yaml_names_the_line(tmp_path):
    assert error_of("name: t\nphases: [\n  - x\n", tmp_path).startswith("not valid YAML: ")
    assert error_of("name: t\nphases: [\n  - x\n", tmp_path).endswith("(line 3)")


def test_unknown_field_suggests_the_right_one(tmp_path):
    text = edit("    weights:\n      web: 0.6", "    wieghts:\n      web: 0.6")
    assert error_of(text, tmp_path) == (
        "phases[0].weights: required field missing (line 10); phases[0].wieghts: unknown field; did you mean "
        "weights? (line 12)"
    )


def test_wrong_types(tmp_path):
    assert error_of(edit("batch_size: 10", "batch_size: ten"), tmp_path) == (
        "batch_size: expected a whole number, got 'ten' (line 5)"
    )
    assert error_of(edit("batch_size: 10", "batch_size: 0"), tmp_path) == (
        "batch_size: must be greater than 0, got 0 (line 5)"
    )
    assert error_of(edit("      web: 0.6", "      web: lots"), tmp_path) == (
        "phases[0].weights.web: expected a finite number, got 'lots' (line 13)"
    )


def test_missing_required_fields(tmp_path):
    assert error_of("name: t\ntotal_tokens: 1M\n", tmp_path) == (
        "tokenizer: required field missing (or give slice_of) (line 1); "
        "sequence_length: required field missing (or give slice_of) (line 1); "
        "batch_size: required field missing (or give slice_of) (line 1); "
        "phases: required field missing (or give slice_of) (line 1)"
    )


def test_empty_and_non_mapping_files(tmp_path):
    assert error_of("", tmp_path) == "empty file: a mixture is a mapping of fields (line 1)"
    assert error_of("- a\n- b\n", tmp_path).startswith("a mixture is a mapping of fields")


def test_bad_patterns_and_names(tmp_path):
    text = edit("      web: 0.6\n", "      domain=web/quality>=7: 0.6\n")
    assert error_of(text, tmp_path) == (
        "phases[0].weights.domain=web/quality>=7: bad quality '7' in 'domain=web/quality>=7': "
        "expected a bucket 0..4 (line 13)"
    )
    text = edit("  web: {cells: domain=web/*", "  web: {cells: webstuff")
    assert error_of(text, tmp_path).startswith("sources.web.cells[0]: not a cell or pattern: 'webstuff'")


def test_duplicate_phase_names(tmp_path):
    text = edit("  - name: midtraining", "  - name: pretraining")
    assert error_of(text, tmp_path) == "phases[1].name: duplicate phase name (also phases[0]) (line 15)"


def test_patterns_as_weight_keys_make_implicit_sources(tmp_path):
    text = edit("      web: 0.6\n      code: 0.4\n", "      domain=web/*: 0.6\n      quality>=3: 0.4\n")
    mixture = load(text, tmp_path)
    assert mixture.sources["quality>=3"].implicit
    assert mixture.sources["domain=web/*"].selectors[0].matches("domain=web/quality=0")


def test_source_shorthand(tmp_path):
    text = edit(
        "  web: {cells: domain=web/*, tokens: 10M}", "  web: domain=web/*\n  more: [domain=web/quality=1]"
    )
    mixture = load(text, tmp_path)
    assert [s.text for s in mixture.sources["web"].selectors] == ["domain=web/*"]


def test_share_as_percent(tmp_path):
    mixture = load(edit("    share: 0.8", '    share: "80%"'), tmp_path)
    assert mixture.phases[0].budget == 800_000


# -- slices ------------------------------------------------------------------------------------------------


def test_slice_may_not_redefine_the_mixture(tmp_path):
    (tmp_path / "full.yaml").write_text(BASE)
    text = "name: small\nslice_of: full.yaml\ntotal_tokens: 100K\nshortfall: redistribute\n"
    assert error_of(text, tmp_path) == "shortfall: not allowed in a slice: it comes from full.yaml (line 4)"


def test_slice_cannot_be_bigger_than_its_run(tmp_path):
    (tmp_path / "full.yaml").write_text(BASE)
    assert error_of("name: big\nslice_of: full.yaml\ntotal_tokens: 2M\n", tmp_path) == (
        "total_tokens: a slice takes between 1 token and its full run's 1M, not 2M (line 3)"
    )


def test_slice_of_a_missing_file(tmp_path):
    message = error_of("name: small\nslice_of: nowhere.yaml\ntotal_tokens: 1K\n", tmp_path)
    assert message.startswith("slice_of: cannot read ") and message.endswith("(line 2)")


def test_errors_in_the_parent_name_the_parent(tmp_path):
    (tmp_path / "full.yaml").write_text(edit("      code: 0.4\n", "      code: 0.3\n"))
    with pytest.raises(MixtureError) as caught:
        load("name: small\nslice_of: full.yaml\ntotal_tokens: 100K\n", tmp_path)
    assert caught.value.file == str(tmp_path / "full.yaml")
    assert str(caught.value).startswith("phases[0].weights: weights sum to 0.9")


# -- selectors ---------------------------------------------------------------------------------------------

CELLS = [f"domain={d}/quality={q}" for d in ("web", "code", "math") for q in range(5)]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("domain=code/*", [f"domain=code/quality={q}" for q in range(5)]),
        ("quality>=3", [f"domain={d}/quality={q}" for d in ("web", "code", "math") for q in (3, 4)]),
        ("domain=web/quality>=3", ["domain=web/quality=3", "domain=web/quality=4"]),
        ("tokens/domain=web/quality=3", ["domain=web/quality=3"]),
        ("gs://bucket/run/tokens/domain=web/quality=3/", ["domain=web/quality=3"]),
        ("domain!=web/quality<1", ["domain=code/quality=0", "domain=math/quality=0"]),
        ("domain=*/quality=4", [f"domain={d}/quality=4" for d in ("web", "code", "math")]),
        ("domain=m*/quality=[01]", ["domain=math/quality=0", "domain=math/quality=1"]),
        ("*", CELLS),
    ],
)
def test_selectors(selector, expected):
    assert sorted(parse_selector(selector).select(CELLS)) == sorted(expected)


def test_exact_cell_selector():
    assert parse_selector("tokens/domain=web/quality=3").cell == "domain=web/quality=3"
    assert parse_selector("domain=web/*").cell is None


@pytest.mark.parametrize(
    "bad", ["web", "domain>web", "quality=9", "quality>=x", "domain=web/domain=code", ""]
)
def test_bad_selectors(bad):
    with pytest.raises(ValueError):
        parse_selector(bad)


# -- shipped mixtures and the schema -----------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(MIXTURES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_mixture_checks(path):
    mixture = load_mixture(path)
    assert mixture.name == path.stem


def test_schema_is_json_and_describes_the_fields():
    schema = mixture_json_schema()
    json.dumps(schema)
    assert {"name", "total_tokens", "phases", "sources", "slice_of", "block_size"} <= set(
        schema["properties"]
    )
    assert schema["properties"]["phases"]["anyOf"][0]["items"]["$ref"] == "#/$defs/PhaseSpec"
    assert schema["$defs"]["PhaseSpec"]["additionalProperties"] is False


def test_text_without_a_file(tmp_path):
    mixture = load_mixture_text(BASE)
    assert mixture.file is None
    with pytest.raises(MixtureError) as caught:
        load_mixture_text(BASE.replace("code: 0.4", "code: 0.3"))
    assert caught.value.file is None


def test_load_mixture_takes_pathlike(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(BASE)
    assert load_mixture(os.fspath(path)).name == load_mixture(path).name
