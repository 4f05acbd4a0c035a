"""Parameter counts and compute of the shipped model shapes: Marin's five reproduce the reference's exact
integers and C constants, the other families keep their own names, and `tokenmill model info`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.trainer.model.flops import (
    count_params,
    flops_per_token,
    forecast_compute,
    mean_causal_context,
    stored_params_from_shapes,
    train_flops,
)
from tokenmill.trainer.model.shape import load_model_config

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"

# Marin's published shapes: file -> (name, total, active, steps, sequences per step, C of the forecast).
# fmt: off
# The C constants are the ones Marin's forecast script holds (floats; our C is an exact integer).
MARIN = {
    "marin-d768.yaml": ("1.6B-A61M", 1_588_199_424, 60_555_264, 11_420, 1024, 2.649679880270119e19),
    "marin-d1024.yaml": ("4.0B-A162M", 3_973_054_464, 162_004_992, 15_276, 2048, 1.7261182741798453e20),
    "marin-d1536.yaml": ("11.5B-A481M", 11_520_442_368, 481_296_384, 15_128, 6144, 1.3813258500033133e21),
    "marin-d2048.yaml": ("27.7B-A1.2B", 27_717_533_696, 1_170_735_104, 20_072, 11264, 7.741814947656449e21),
    "marin-535b-a23b.yaml": ("535B-A23B", 535_305_388_032, 22_762_487_808, 390_251, 11264,
                             2.6108941613772703e24),
}
# fmt: on
# Marin's published FLOPs with the head (the ladder's docstring and the hero's ~2.70e24), two digits.
WITH_HEAD = {
    "1.6B-A61M": 5.5e19,
    "4.0B-A162M": 2.7e20,
    "11.5B-A481M": 1.8e21,
    "27.7B-A1.2B": 9.2e21,
    "535B-A23B": 2.7e24,
}  # fmt: skip
HERO_STORED = 535_477_106_688
DSV3 = ["dsv3-d512.yaml", "dsv3-d768.yaml", "dsv3-d1280.yaml", "dsv3-d2048.yaml", "dsv3-d5120.yaml"]


@pytest.mark.parametrize("file", sorted(MARIN))
def test_marin_shapes_reproduce_the_reference_exactly(file):
    name, total, active, steps, batch, c_marin = MARIN[file]
    cfg = load_model_config(MODELS / file)
    counts = count_params(cfg)
    assert cfg.name == name
    assert (counts.total_params, counts.active_params) == (total, active)
    assert counts.total_params - counts.embedding_params == total - 2 * 128_256 * cfg.d_model
    # The ladder's rule: steps = round(791 x active / tokens per step), at the recorded batch.
    assert (cfg.reference_run.steps, cfg.reference_run.batch_size) == (steps, batch)
    assert round(791 * active / (batch * 4096)) == steps
    tokens = steps * batch * 4096
    c = forecast_compute(cfg, tokens)
    assert isinstance(c, int) and abs(c / c_marin - 1) < 1e-9
    with_head = train_flops(cfg, tokens)
    assert with_head - c == 6 * cfg.d_model * 128_256 * tokens
    assert with_head == pytest.approx(WITH_HEAD[name], rel=0.02)


@pytest.mark.parametrize("file", [*sorted(MARIN), *DSV3, "tiny.yaml", "tiny-marin.yaml"])
def test_stored_count_formula_equals_the_initialised_pytree(file):
    cfg = load_model_config(MODELS / file)
    assert count_params(cfg).stored_params == stored_params_from_shapes(cfg)


def test_hero_stored_count_is_the_published_one():
    cfg = load_model_config(MODELS / "marin-535b-a23b.yaml")
    counts = count_params(cfg)
    assert counts.stored_params == HERO_STORED
    # What stored adds to total: norms, GatedNorm, the attention gate, SConv at k/attn/mlp, the router bias.
    assert counts.stored_params - counts.total_params == 171_718_656


def test_the_reference_names_belong_to_marin_shapes_only():
    names = {load_model_config(path).name: path.name for path in MODELS.glob("*.yaml")}
    for file, (name, *_rest) in MARIN.items():
        assert names[name] == file
    assert all(load_model_config(MODELS / file).name == file.removesuffix(".yaml") for file in DSV3)


def test_every_shipped_config_loads():
    names = {path.name for path in MODELS.glob("*.yaml")}
    assert set(MARIN) | set(DSV3) | {"tiny.yaml", "tiny-marin.yaml"} <= names
    for path in MODELS.glob("*.yaml"):
        load_model_config(path)


def test_mfu_flops_count_the_matrices_and_causal_attention():
    cfg = load_model_config(MODELS / "marin-535b-a23b.yaml")
    counts = count_params(cfg)
    d, layers = cfg.d_model, cfg.n_layers
    gated_and_gate = layers * (2 * 2 * d * 128 + d * cfg.n_heads) + 2 * 2 * d * 128
    per_token = flops_per_token(cfg)
    attention = per_token - 6 * (counts.active_params + gated_and_gate)
    # 12 global layers see (S+1)/2 keys on average, the 36 windowed ones 3/4 of the window.
    expected = 3 * 4 * 48 * 128 * (12 * 2048.5 + 36 * mean_causal_context(4096, 2048))
    assert attention == pytest.approx(expected)


def test_causal_context_with_and_without_a_window():
    assert mean_causal_context(4) == 2.5  # (1 + 2 + 3 + 4) / 4
    assert mean_causal_context(4, window=2) == (1 + 2 + 2 + 2) / 4
    assert mean_causal_context(4, window=8) == 2.5


def test_model_info_command(capsys):
    assert main(["model", "info", str(MODELS / "marin-535b-a23b.yaml"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == 535_305_388_032 and info["active_params"] == 22_762_487_808
    assert info["stored_params"] == HERO_STORED
    assert info["tokens"] == 390_251 * 11_264 * 4096
    assert abs(info["forecast_compute"] / 2.6108941613772703e24 - 1) < 1e-9
    assert info["train_flops"] == pytest.approx(2.7e24, rel=0.01)
    # --tokens replaces the reference run's count.
    assert main(["model", "info", str(MODELS / "marin-d768.yaml"), "--tokens", "1B", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] == 10**9 and info["forecast_compute"] == info["forecast_flops_per_token"] * 10**9
    assert main(["model", "info", str(MODELS / "marin-d768.yaml")]) == 0
    text = capsys.readouterr().out
    assert "1.588B total, 60.56M active" in text and "1,588,199,424" in text and "11,420 steps" in text
    # A shape without a reference run and no --tokens prints counts only.
    assert main(["model", "info", str(MODELS / "tiny.yaml"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] is None and info["forecast_compute"] is None
    assert main(["model", "info", str(MODELS / "tiny.yaml"), "--tokens", "lots"]) == 2
    assert "not a count" in capsys.readouterr().err
