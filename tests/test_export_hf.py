"""`tokenmill export hf` (docs/export.md): a trained DeepSeek-style checkpoint loads in transformers as the
stock Dots1ForCausalLM with logits equal to tokenmill's forward (fp32, packed and unpacked rows), greedy
generate() equal to tokenmill's greedy decode, a bf16 export within bf16 rounding, offline in a fresh
process; bad runs and options the class cannot express are refused by name; import gives the parameters back
and `train --checkpoint.init_from` continues from them."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenmill.cli import main  # noqa: E402
from tokenmill.export.hf import RECORD, check_exportable, import_hf, unsupported_options  # noqa: E402
from tokenmill.export.reference import dropless, greedy_decode  # noqa: E402
from tokenmill.export.run import ExportError, load_checkpoint  # noqa: E402
from tokenmill.export.tensors import INDEX  # noqa: E402
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig, load_model_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def small_model() -> ModelConfig:
    """tiny.yaml's family at test size: a windowed layer then a global one, QK-norm, one shared expert,
    sigmoid routing with a bias that moves fast enough to be far from zero after a few steps."""
    return ModelConfig(
        name="export-test", vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        sequence_length=48, sliding_window=8, sliding_window_layers=[0],
        moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1, bias_rate=0.05,
                      route_scale=1.5, capacity_factor=1.25),
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    from tokenmill.tokenize.tokenizer import train_byte_level_bpe

    text = ["the quick brown fox jumps over the lazy dog and the cat sat on the mat " * 20]
    tokenizer = train_byte_level_bpe([text], vocab_size=300)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def run_config(output: Path, **checkpoint: object):
    """The tests' run: STEPS steps of small_model() on synthetic tokens, checkpoints every 2 steps."""
    from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config

    config = RunConfig.model_validate(
        {"output": str(output), "model": small_model().model_dump(),
         "data": {"batch_size": 4, "synthetic": True},
         "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 1, "steps": STEPS},
         "logging": {"peak_flops": 1e9}, "checkpoint": {"every": 2, "asynchronous": False, **checkpoint}}
    )  # fmt: skip
    return resolve_run_config(config, [Phase("pretraining", 0, STEPS)])


def synthetic():
    from tokenmill.trainer.data.batch import SyntheticSource

    cfg = small_model()
    return SyntheticSource(cfg.vocab_size, cfg.sequence_length, 4, 0, active_vocab=64)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run folder: STEPS steps of small_model() on synthetic tokens, checkpoints at steps 2 and 4."""
    from tokenmill.trainer.run.loop import train

    run_dir = tmp_path_factory.mktemp("export") / "run"
    train(run_config(run_dir), synthetic())
    return run_dir


@pytest.fixture(scope="module")
def exported(trained, tokenizer_path, tmp_path_factory) -> dict[str, Path]:
    """The run's latest checkpoint exported in fp32 (small shards, so the index spans several) and bf16."""
    base = tmp_path_factory.mktemp("hf")
    folders = {"fp32": base / "fp32", "bf16": base / "bf16"}
    for dtype, folder in folders.items():
        code = main(["export", "hf", "--run", str(trained), "--output", str(folder), "--dtype", dtype,
                     "--tokenizer", str(tokenizer_path), "--max-shard-size", "40K"])  # fmt: skip
        assert code == 0
    return folders


@pytest.fixture(scope="module")
def checkpoint(trained):
    return load_checkpoint(str(trained))


_FORWARDS: dict[str, object] = {}


def tokenmill_logits(checkpoint, tokens: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """tokenmill's fp32 forward with dropless experts (one compiled program per model shape)."""
    from tokenmill.trainer.model import transformer

    cfg = dropless(checkpoint.model)
    key = cfg.model_dump_json()
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(lambda p, b, t, s: transformer.forward(p, b, t, s, cfg)[0])
    return np.asarray(_FORWARDS[key](checkpoint.params, checkpoint.router_bias, tokens, segments))


def bf16_rounded(params: dict) -> dict:
    """The parameters a bf16 export holds: every tensor rounded to bf16 but the router (fp32)."""
    import ml_dtypes

    def rounded(path: tuple, leaf: np.ndarray) -> np.ndarray:
        if any(getattr(entry, "key", None) == "router" for entry in path):
            return leaf
        return leaf.astype(ml_dtypes.bfloat16).astype(np.float32)

    return jax.tree_util.tree_map_with_path(rounded, params)


def rows(cfg: ModelConfig, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 300, (2, cfg.sequence_length)).astype(np.int32)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    """The largest absolute difference relative to the largest logit."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def load(folder: Path, dtype=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    return model.eval()


def test_the_folder_is_a_dots1_model_with_its_record(exported, trained, checkpoint, tokenizer_path):
    folder = exported["fp32"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Dots1ForCausalLM"] and config["model_type"] == "dots1"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    index = json.loads((folder / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((folder / name).stat().st_size <= 40_000 + 4096 for name in shards)
    # The stacked expert bank is split per expert, as the checkpoints transformers loads are laid out.
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)} <= set(index["weight_map"])
    record = json.loads((folder / RECORD).read_text())
    assert record["step"] == STEPS and record["run"] == str(trained) and record["dtype"] == "fp32"
    assert record["model_sha256"] == checkpoint.model_sha256 and record["plan_sha256"] is None
    import hashlib

    for name, sha256 in record["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == sha256, name
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(record["files"])
    assert (folder / "tokenizer.json").read_bytes() == tokenizer_path.read_bytes()
    assert record["eos_id"] == 0 and config["eos_token_id"] == 0
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 0
    # The router bias the run trained is in the folder (non-zero after a few fast balancing steps).
    assert np.abs(checkpoint.router_bias).max() > 0


def test_fp32_logits_equal_tokenmill_packed_and_unpacked(exported, checkpoint):
    model = load(exported["fp32"])
    cfg = checkpoint.model
    tokens = rows(cfg)
    with torch.no_grad():
        ours = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    unpacked = relative(ours, tokenmill_logits(checkpoint, tokens, np.zeros_like(tokens)))
    # Packed: three documents per row. transformers reads the boundaries from position ids that restart
    # at each document (without a cache); tokenmill from segment ids.
    lengths = (13, 20, cfg.sequence_length - 33)
    segments = np.repeat(np.arange(3), lengths)[None].repeat(2, 0).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])[None].repeat(2, 0)
    with torch.no_grad():
        packed_ours = model(
            torch.tensor(tokens, dtype=torch.long), position_ids=torch.tensor(positions), use_cache=False
        ).logits.numpy()
    reference = tokenmill_logits(checkpoint, tokens, segments)
    packed = relative(packed_ours, reference)
    print(f"fp32 max relative logit difference: unpacked {unpacked:.2e}, packed {packed:.2e}")
    assert unpacked < 1e-4 and packed < 1e-4
    # Packing matters: the rows read as one document give other logits after the first boundary.
    assert relative(ours[:, 13:], reference[:, 13:]) > 1e-2


def test_greedy_generate_equals_tokenmill_greedy_decode(exported, checkpoint):
    model = load(exported["fp32"])
    prompt = rows(checkpoint.model, seed=5)[:, :8]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor(prompt, dtype=torch.long), max_new_tokens=20, min_new_tokens=20, do_sample=False
        ).numpy()
    ours = greedy_decode(checkpoint.params, checkpoint.router_bias, checkpoint.model, prompt, 20)
    assert generated.shape == (2, 28)
    np.testing.assert_array_equal(generated, ours)


def test_bf16_export_agrees_to_bf16_rounding(exported, checkpoint):
    def tensor_bytes(folder: Path) -> int:
        record = json.loads((folder / RECORD).read_text())
        return sum(
            (folder / name).stat().st_size for name in record["files"] if name.endswith(".safetensors")
        )

    assert json.loads((exported["bf16"] / RECORD).read_text())["dtype"] == "bf16"
    assert tensor_bytes(exported["bf16"]) < 0.6 * tensor_bytes(exported["fp32"])
    # The bf16 folder holds exactly the checkpoint rounded to bf16 (the router kept in fp32): loaded in
    # fp32, it computes what tokenmill computes from the rounded weights.
    rounded = copy.copy(checkpoint)
    object.__setattr__(rounded, "params", bf16_rounded(checkpoint.params))
    tokens = rows(checkpoint.model)
    reference = tokenmill_logits(rounded, tokens, np.zeros_like(tokens))
    with torch.no_grad():
        widened = load(exported["bf16"]).forward(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        model = load(exported["bf16"], torch.bfloat16)
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert model.model.layers[0].mlp.gate.e_score_correction_bias.dtype == torch.float32
        ours = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    exact, computed = relative(widened, reference), relative(ours, reference)
    weights = relative(reference, tokenmill_logits(checkpoint, tokens, np.zeros_like(tokens)))
    print(
        f"bf16 export: fp32 compute {exact:.2e}, bf16 compute {computed:.2e} "
        f"(rounding the weights alone: {weights:.2e})"
    )
    assert exact < 1e-4 and computed < 2e-2


def test_loads_offline_in_a_fresh_process(exported, checkpoint, marin_exported, marin_checkpoint):
    script = textwrap.dedent(
        """
        import json, sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        folder, marin, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        # The Marin family: the modeling file in the folder, run as remote code (no network either).
        marin_model = AutoModelForCausalLM.from_pretrained(marin, trust_remote_code=True, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor(tokens)).logits
            marin_logits = marin_model(torch.tensor(tokens)).logits
        print(json.dumps({"eos": tokenizer.eos_token_id, "ids": tokenizer("the cat")["input_ids"],
                          "class": type(model).__name__, "logits": logits[0, -1].tolist(),
                          "marin_class": type(marin_model).__name__,
                          "marin_logits": marin_logits[0, -1].tolist()}))
        """
    )
    tokens = rows(checkpoint.model)[:1]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(exported["fp32"].parent / "hf-home"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script, str(exported["fp32"]), str(marin_exported),
         json.dumps(tokens.tolist())],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["class"] == "Dots1ForCausalLM" and loaded["eos"] == 0
    from tokenmill.tokenize.tokenizer import load_tokenizer

    tokenizer, _ = load_tokenizer(str(exported["fp32"] / "tokenizer.json"))
    assert loaded["ids"] == tokenizer.encode("the cat").ids
    reference = tokenmill_logits(checkpoint, tokens, np.zeros_like(tokens))[0, -1]
    assert relative(np.array(loaded["logits"]), reference) < 1e-4
    assert loaded["marin_class"] == "TokenmillMarinForCausalLM"
    marin_reference = tokenmill_logits(marin_checkpoint, tokens, np.zeros_like(tokens))[0, -1]
    assert relative(np.array(loaded["marin_logits"]), marin_reference) < 1e-4


def test_import_gives_the_parameters_back(exported, checkpoint, tmp_path):
    import jax

    cfg, params, bias, record = import_hf(str(exported["fp32"]))
    assert cfg == checkpoint.model and record["step"] == STEPS
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(checkpoint.params), strict=True)
    assert jax.tree.structure(params) == jax.tree.structure(checkpoint.params)
    assert all(np.array_equal(a, b) for a, b in pairs)
    np.testing.assert_array_equal(bias, checkpoint.router_bias)
    # A changed byte is caught by the record's checksums.
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in exported["fp32"].iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "config.json").write_text((broken / "config.json").read_text().replace("1e-05", "1e-06"))
    with pytest.raises(ExportError, match="config.json: sha256"):
        import_hf(str(broken))
    # The CLI writes a checkpoint that init_from continues from, with the same parameters.
    imported = tmp_path / "imported"
    assert main(["import", "hf", str(exported["fp32"]), "--output", str(imported)]) == 0
    from tokenmill.trainer.run.checkpoint import Checkpointer

    reader = Checkpointer(imported / "checkpoints", read_only=True)
    assert reader.all_steps() == [STEPS]
    meta = reader.read_meta(STEPS)
    reader.close()
    assert meta["model_sha256"] == checkpoint.model_sha256 and meta["step"] == STEPS
    # ... into a new folder only.
    assert main(["import", "hf", str(exported["fp32"]), "--output", str(imported)]) == 2


@pytest.mark.slow
def test_training_continues_from_an_imported_export(exported, trained, tmp_path):
    """`import hf` then `train --checkpoint.init_from`: the first loss is the one the exported parameters
    give batch 0, not a fresh model's."""
    from tokenmill.trainer.model import transformer
    from tokenmill.trainer.run.loop import train

    imported = tmp_path / "imported"
    assert main(["import", "hf", str(exported["fp32"]), "--output", str(imported)]) == 0
    cfg, params, bias, _ = import_hf(str(exported["fp32"]))
    continued = train(run_config(tmp_path / "continued", init_from=str(imported)), synthetic(), stop_after=1)
    batch = synthetic().batch(0)
    expected = transformer.loss_fn(params, bias, batch.tokens, batch.segment_ids, cfg)[1][0]
    assert continued[0]["loss"] == pytest.approx(float(expected), rel=1e-5)
    first = json.loads((trained / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - continued[0]["loss"]) > 1e-3


def test_bad_runs_are_refused_with_clear_errors(trained, tokenizer_path, tmp_path, exported, capsys):
    def export(run: Path, *flags: str) -> str:
        code = main(["export", "hf", "--run", str(run), "--output", str(tmp_path / "out"),
                     "--tokenizer", str(tokenizer_path), *flags])  # fmt: skip
        assert code == 2
        return capsys.readouterr().err

    assert "not a run folder" in export(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_bytes((trained / "config.json").read_bytes())
    assert "the run has no checkpoints" in export(empty)
    assert "no checkpoint of step 3 (it has: 2, 4)" in export(trained, "--step", "3")
    assert load_checkpoint(str(trained / "checkpoints" / "2")).step == 2
    assert "differs from the checkpoint" in export(trained / "checkpoints" / "2", "--step", "4")
    # Another model in config.json than the checkpoint holds.
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((trained / "config.json").read_text())
    config["model"]["moe"]["route_scale"] = 2.0
    (other / "config.json").write_text(json.dumps(config))
    os.symlink(trained / "checkpoints", other / "checkpoints")
    error = export(other)
    assert "holds another model" in error and "model.moe.route_scale: 1.5 -> 2.0" in error
    # An output that holds an export already.
    code = main(["export", "hf", "--run", str(trained), "--output", str(exported["fp32"]),
                 "--tokenizer", str(tokenizer_path)])  # fmt: skip
    assert code == 2
    assert f"already holds an export of {trained} at step {STEPS}" in capsys.readouterr().err
    # --overwrite replaces an export, never another folder (a run folder has a config.json too).
    code = main(["export", "hf", "--run", str(trained), "--output", str(trained), "--overwrite",
                 "--tokenizer", str(tokenizer_path)])  # fmt: skip
    assert code == 2 and "no export record" in capsys.readouterr().err
    assert (trained / "config.json").exists()


def test_options_the_stock_class_cannot_express_are_refused_by_name():
    assert unsupported_options(load_model_config(REPO / "configs" / "models" / "tiny.yaml")) == []
    marin = load_model_config(REPO / "configs" / "models" / "tiny-marin.yaml")
    problems = " ".join(unsupported_options(marin))
    for option in ("moe.bias_space", "moe.latent_dim", "global_kv_heads", "rope_dims", "rope_interleaved",
                   "rope_on_global_layers", "qk_mult", "embed_norm", "gated_norm_rank", "xsa", "attn_gate",
                   "sconv_sites"):  # fmt: skip
        assert option + ":" in problems, option
    softmax = small_model().model_copy(
        update={"moe": small_model().moe.model_copy(update={"score_fn": "softmax"})}
    )
    with pytest.raises(ExportError, match="moe.score_fn: softmax"):
        check_exportable(softmax)


def test_export_to_and_import_from_gcs(gcs, checkpoint, tokenizer_path):
    from tokenmill.export.hf import export_hf

    folder = gcs.url("export/hf")
    record = export_hf(checkpoint, folder, "fp32", str(tokenizer_path), shard_bytes=40_000)
    fs = gcs.filesystem()
    listed = {path.rsplit("/", 1)[-1] for path in fs.ls(f"{gcs.bucket}/export/hf")}
    assert listed == {*record["files"], RECORD}
    cfg, params, bias, _ = import_hf(folder)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(checkpoint.params))
    )
    np.testing.assert_array_equal(bias, checkpoint.router_bias)
    with pytest.raises(ExportError, match="already holds an export"):
        export_hf(checkpoint, folder, "fp32", str(tokenizer_path))


def test_the_tokenizer_beside_the_runs_tokens_is_found_when_its_hash_matches(tmp_path, tokenizer_path):
    from types import SimpleNamespace

    from tokenmill.export.commands import default_tokenizer
    from tokenmill.tokenize.tokenizer import sha256_bytes

    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    sha = sha256_bytes(tokenizer_path.read_bytes())
    run = SimpleNamespace(record={"data": {"tokens": str(tmp_path / "tokens")}}, tokenizer_sha256=sha)
    assert default_tokenizer(run) == str(tmp_path / "tokenizer.json")
    assert default_tokenizer(SimpleNamespace(record=run.record, tokenizer_sha256="0" * 64)) is None


# --- the Marin family: the modeling file tokenmill ships -------------------------------------------------


def marin_model() -> ModelConfig:
    cfg = load_model_config(REPO / "configs" / "models" / "tiny-marin.yaml")
    return cfg.model_copy(update={"vocab_size": 320, "sequence_length": 48})


@pytest.fixture(scope="module")
def marin_checkpoint():
    """tiny-marin's parameters with every piece away from its identity init (gates, SConv taps, norm
    scales, GatedNorm) and a router bias far from zero, as a checkpoint of a run."""
    from tokenmill.export.run import RunCheckpoint
    from tokenmill.trainer.model import transformer

    cfg = marin_model()
    rng = np.random.default_rng(0)
    # Drawn straight into init_params' layout (its shapes only: compiling or running the init costs more
    # than the rest of the test): norm scales around 1, every other tensor N(0, 0.3^2).
    shapes = jax.eval_shape(lambda key: transformer.init_params(key, cfg), jax.random.key(0))
    params = jax.tree.map(
        lambda x: ((x.ndim == 1) + 0.3 * rng.standard_normal(x.shape)).astype(np.float32), shapes
    )
    bias = (0.3 * rng.standard_normal((cfg.n_layers, cfg.moe.n_experts))).astype(np.float32)
    return RunCheckpoint("runs/marin-test", 7, cfg, params, bias, {"phase": "pretraining"}, "0" * 64, {})


@pytest.fixture(scope="module")
def marin_exported(marin_checkpoint, tokenizer_path, tmp_path_factory) -> Path:
    from tokenmill.export.hf import export_hf

    folder = tmp_path_factory.mktemp("marin") / "hf"
    export_hf(marin_checkpoint, str(folder), "fp32", str(tokenizer_path), shard_bytes=60_000)
    return folder


def test_marin_family_loads_through_the_shipped_modeling_file(marin_exported, marin_checkpoint):
    from transformers import AutoModelForCausalLM

    config = json.loads((marin_exported / "config.json").read_text())
    assert config["architectures"] == ["TokenmillMarinForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_tokenmill.TokenmillMarinForCausalLM"
    shipped = REPO / "src" / "tokenmill" / "export" / "modeling_marin.py"
    assert (marin_exported / "modeling_tokenmill.py").read_bytes() == shipped.read_bytes()
    record = json.loads((marin_exported / RECORD).read_text())
    assert (
        "modeling_tokenmill.py" in record["files"] and record["architecture"] == "TokenmillMarinForCausalLM"
    )

    model = AutoModelForCausalLM.from_pretrained(marin_exported, trust_remote_code=True, dtype=torch.float32)
    model.eval()
    cfg = marin_checkpoint.model
    tokens = rows(cfg)
    lengths = (13, 20, cfg.sequence_length - 33)
    segments = np.repeat(np.arange(3), lengths)[None].repeat(2, 0).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])[None].repeat(2, 0)
    with torch.no_grad():
        ours = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
        packed_ours = model(
            torch.tensor(tokens, dtype=torch.long), position_ids=torch.tensor(positions)
        ).logits
    reference = tokenmill_logits(marin_checkpoint, tokens, segments)
    unpacked = relative(ours, tokenmill_logits(marin_checkpoint, tokens, np.zeros_like(tokens)))
    packed = relative(packed_ours.numpy(), reference)
    print(f"Marin fp32 max relative logit difference: unpacked {unpacked:.2e}, packed {packed:.2e}")
    assert unpacked < 1e-4 and packed < 1e-4
    assert relative(ours[:, 13:], reference[:, 13:]) > 1e-2  # SConv and attention stay inside documents


@pytest.mark.slow
def test_marin_bf16_export_holds_the_rounded_weights(marin_checkpoint, tmp_path):
    """Loaded in fp32, the bf16 folder computes tokenmill's forward of the bf16-rounded weights. (This
    randomised tiny-marin is too sensitive for a bf16-compute comparison: rounding its weights alone moves
    its logits by a third, tokenmill's own bf16 compute by more.)"""
    from transformers import AutoModelForCausalLM

    from tokenmill.export.hf import export_hf

    export_hf(marin_checkpoint, str(tmp_path / "bf16"), "bf16")
    rounded = copy.copy(marin_checkpoint)
    object.__setattr__(rounded, "params", bf16_rounded(marin_checkpoint.params))
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "bf16", trust_remote_code=True, dtype=torch.float32
    )
    tokens = rows(marin_checkpoint.model)
    with torch.no_grad():
        ours = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert relative(ours, tokenmill_logits(rounded, tokens, np.zeros_like(tokens))) < 1e-4


@pytest.mark.slow
def test_marin_generate_and_import(marin_exported, marin_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(marin_exported, trust_remote_code=True, dtype=torch.float32)
    cfg = marin_checkpoint.model
    prompt = rows(cfg, seed=5)[:, :8]
    with torch.no_grad():
        generated = model.generate(
            torch.tensor(prompt, dtype=torch.long), max_new_tokens=20, min_new_tokens=20, do_sample=False
        ).numpy()
    ours = greedy_decode(marin_checkpoint.params, marin_checkpoint.router_bias, cfg, prompt, 20)
    np.testing.assert_array_equal(generated, ours)

    cfg_back, params, bias, _ = import_hf(str(marin_exported))
    assert cfg_back == cfg and jax.tree.structure(params) == jax.tree.structure(marin_checkpoint.params)
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(marin_checkpoint.params), strict=True)
    assert all(np.array_equal(a, b) for a, b in pairs)
    np.testing.assert_array_equal(bias, marin_checkpoint.router_bias)


def test_the_stock_class_refuses_the_marin_family_by_name(marin_checkpoint, tmp_path):
    from tokenmill.export.hf import export_hf

    with pytest.raises(ExportError, match="cannot be exported as Dots1ForCausalLM.*moe.latent_dim: 32"):
        export_hf(marin_checkpoint, str(tmp_path / "out"), architecture="dots1")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_trained_marin_run_exports_through_the_command_line(tmp_path, tokenizer_path):
    from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
    from tokenmill.trainer.run.loop import train

    cfg = marin_model()
    config = RunConfig.model_validate(
        {"output": str(tmp_path / "run"), "model": cfg.model_dump(),
         "data": {"batch_size": 4, "synthetic": True},
         "schedule": {"steps": 3}, "logging": {"peak_flops": 1e9}, "checkpoint": {"asynchronous": False}}
    )  # fmt: skip
    source = synthetic().__class__(cfg.vocab_size, cfg.sequence_length, 4, 0, active_vocab=64)
    train(resolve_run_config(config, [Phase("pretraining", 0, 3)]), source)
    folder = tmp_path / "hf"
    assert main(["export", "hf", "--run", str(tmp_path / "run"), "--output", str(folder), "--dtype", "fp32",
                 "--tokenizer", str(tokenizer_path)]) == 0  # fmt: skip
    checkpoint = load_checkpoint(str(tmp_path / "run"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    tokens = rows(cfg)
    with torch.no_grad():
        ours = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    difference = relative(ours, tokenmill_logits(checkpoint, tokens, np.zeros_like(tokens)))
    print(f"trained Marin run, fp32 max relative logit difference: {difference:.2e}")
    assert difference < 1e-4
