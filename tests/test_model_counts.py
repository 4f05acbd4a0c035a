"""Parameter and FLOP counts of the shipped model shapes reproduce their names, and `tokenmill model info`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.trainer.config import load_model_config
from tokenmill.trainer.flops import count_params, flops_per_token, mean_causal_context

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"

# file -> (total, active) that the name promises
NAMED = {
    "ladder-1.6b-a61m.yaml": (1.6e9, 61e6),
    "ladder-4.0b-a162m.yaml": (4.0e9, 162e6),
    "ladder-11.5b-a481m.yaml": (11.5e9, 481e6),
    "ladder-27.7b-a1.2b.yaml": (27.7e9, 1.2e9),
    "hero-535b-a23b.yaml": (535e9, 23e9),
}


@pytest.mark.parametrize("name", sorted(NAMED))
def test_counts_reproduce_the_names_within_3_percent(name):
    total, active = NAMED[name]
    counts = count_params(load_model_config(MODELS / name))
    assert counts.total_params == pytest.approx(total, rel=0.03)
    assert counts.active_params == pytest.approx(active, rel=0.03)


def test_hero_flops_at_18_75T_tokens():
    cfg = load_model_config(MODELS / "hero-535b-a23b.yaml")
    total = flops_per_token(cfg) * 18.75e12
    assert total == pytest.approx(2.7e24, rel=0.05)
    # The convention: 6 x active parameters per token, plus attention on top.
    assert flops_per_token(cfg) > 6 * count_params(cfg).active_params


def test_every_shipped_config_loads():
    names = {path.name for path in MODELS.glob("*.yaml")}
    assert set(NAMED) | {"tiny.yaml"} <= names
    for path in MODELS.glob("*.yaml"):
        load_model_config(path)


def test_causal_context_with_and_without_a_window():
    assert mean_causal_context(4) == 2.5  # (1 + 2 + 3 + 4) / 4
    assert mean_causal_context(4, window=2) == (1 + 2 + 2 + 2) / 4
    assert mean_causal_context(4, window=8) == 2.5


def test_model_info_command(capsys):
    assert main(["model", "info", str(MODELS / "hero-535b-a23b.yaml"), "--tokens", "18.75T", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"total_params", "active_params", "flops_per_token", "total_flops"} <= set(info)
    assert info["total_flops"] == pytest.approx(2.7e24, rel=0.05)
    assert main(["model", "info", str(MODELS / "ladder-1.6b-a61m.yaml")]) == 0
    text = capsys.readouterr().out
    assert "1.6B total" in text and "61.3M active" in text
    assert main(["model", "info", str(MODELS / "tiny.yaml"), "--tokens", "lots"]) == 2
    assert "not a count" in capsys.readouterr().err
