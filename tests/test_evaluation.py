"""Held-out evaluation while training and of checkpoints: fixed sequences of whole documents, exact bits per
byte (checked against an independent forward and the documents' original text), one compiled step per
dispatch, eval.jsonl rows that a resumed run repeats, and `tokenmill eval`.

The curated cells are written here (texts with non-ASCII characters, so that bytes and characters differ),
a byte-level BPE is trained on them, and `tokenmill tokenize` sets aside held-out slices by id hash.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_on_simulated_devices
from test_heldout import write_rows
from test_tokenize import WORDS

from tokenmill.cli import main
from tokenmill.formats.plan import read_plan
from tokenmill.mixtures.plan import _heldout_groups
from tokenmill.tokenize import TokenCatalog
from tokenmill.tokenize.tokenizer import load_tokenizer
from tokenmill.trainer.data.evaluation import build_sequences, load_sequences, round_robin
from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.shape import load_model_config
from tokenmill.trainer.model.sharding import make_mesh
from tokenmill.trainer.run.evaluate import Evaluator, with_dispatch

TINY = Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny.yaml"
#: Unoptimised CPU code generation for the reference programs compiled here (run once each, on tiny
#: shapes): compiling at LLVM's default level took about twice as long.
QUICK_COMPILE = {"xla_backend_optimization_level": 0}
ACCENTS = ["café", "naïve", "Zürich", "façade", "smörgåsbord", "日本語", "Ελληνικά", "—", "½"]


def text_of(number: int) -> str:
    rng = np.random.default_rng(1000 + number)
    words = [
        ACCENTS[i % len(ACCENTS)] if i % 5 == 0 else WORDS[i % len(WORDS)]
        for i in rng.integers(0, 10 * len(WORDS), size=int(rng.integers(6, 60)))
    ]
    return f"doc {number}: {' '.join(words)}.\n"


TEXTS = {f"crawl/part.jsonl:{n}": text_of(n) for n in range(300)}
BY_TEXT = {text: doc_id for doc_id, text in TEXTS.items()}

MIXTURE = """\
name: eval-test
tokenizer: tokenmill-bpe-400
total_tokens: 16K
sequence_length: 32
batch_size: 4
max_epochs: 50
phases:
  - name: pretraining
    share: 0.75
    weights: {domain=prose/*: 0.5, domain=notes/*: 0.5}
  - name: midtraining
    share: 0.25
    weights: {domain=prose/*: 0.2, domain=notes/*: 0.8}
evaluation:
  heldout: domain=*/*
  group_by: domain
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Tokens with held-out slices (two domains, three cells), the tokenizer, and the plan."""
    root = tmp_path_factory.mktemp("eval")
    items = sorted(TEXTS.items())
    curated = root / "curated"
    write_rows(curated, "prose", 2, 0, 1, items[0::3])
    write_rows(curated, "prose", 3, 0, 1, items[1::3])
    write_rows(curated, "notes", 1, 0, 1, items[2::3])
    tokenizer = root / "tokenizer.json"
    argv = ["tokenizer", "train", "--input", str(curated), "--vocab-size", "400", "--output", str(tokenizer)]
    assert main(argv) == 0
    tokens = root / "tokens"
    argv = ["tokenize", "--input", str(curated), "--output", str(tokens), "--tokenizer", str(tokenizer),
            "--workers", "1", "--progress-seconds", "0", "--heldout-fraction", "0.2"]  # fmt: skip
    assert main(argv) == 0
    spec = root / "mixture.yaml"
    spec.write_text(MIXTURE)
    plan_path = root / "plan.json"
    assert main(["mixture", "plan", str(spec), "--counts", str(tokens / "counts.json"), "--json",
                 "--output", str(plan_path)]) == 0  # fmt: skip
    return {"root": root, "tokens": tokens, "tokenizer": tokenizer, "plan": read_plan(str(plan_path)),
            "plan_path": plan_path, "mixture": spec}  # fmt: skip


def test_sequences_are_whole_documents_in_round_robin_with_bytes_of_the_text(corpus):
    plan, tokens = corpus["plan"], corpus["tokens"]
    tokenizer, info = load_tokenizer(str(corpus["tokenizer"]))
    assert [s.name for s in plan.evaluation] == ["heldout/domain=notes", "heldout/domain=prose"]
    catalog = TokenCatalog(str(tokens))
    prose = plan.evaluation[1]
    assert len(prose.cells) == 2
    readers = [catalog.heldout(cell) for cell in prose.cells]
    sets = load_sequences(plan, str(tokens), 32, 6)
    again = load_sequences(plan, str(tokens), 32, 6)
    for first, second in zip(sets, again, strict=True):
        np.testing.assert_array_equal(first.tokens, second.tokens)
        np.testing.assert_array_equal(first.mask, second.mask)
    made = sets[1]
    # Independently: the original texts of the held-out documents, in round-robin order over the cells,
    # encoded again and laid out as the module docstring says.
    order = [BY_TEXT[tokenizer.decode(reader.document(i).tolist())] for reader, i in round_robin(readers)]
    stream, texts = [info.eos_id], []
    for doc_id in order:
        ids = tokenizer.encode(TEXTS[doc_id], add_special_tokens=False).ids
        if len(stream) - 1 + len(ids) + 1 > 6 * 32:
            break
        stream += [*ids, info.eos_id]
        texts.append(TEXTS[doc_id])
    assert made.documents == len(texts) > 2 and made.scored_tokens == len(stream) - 1
    assert made.num_bytes == sum(len(text.encode("utf-8")) for text in texts)
    assert made.num_bytes > sum(len(text) for text in texts)  # the accents are counted as bytes
    flat = made.tokens[:, :-1].reshape(-1)
    np.testing.assert_array_equal(flat[: len(stream) - 1], stream[:-1])
    np.testing.assert_array_equal(made.tokens[:, 1:].reshape(-1)[made.mask.reshape(-1) > 0], stream[1:])
    assert made.mask.sum() == made.scored_tokens
    # The set is cut at the first document that does not fit; a set too small for one document is refused.
    with pytest.raises(ValueError, match="nothing fits in 1 sequences of 4 tokens"):
        build_sequences("tiny", "heldout", readers, 4, 1)
    with pytest.raises(KeyError, match="heldout/domain=nope"):
        load_sequences(plan, str(tokens), 32, 6, names=["heldout/domain=nope"])


def reference_sums(params, bias, model_cfg, sequences) -> float:
    """Summed nll of a set's scored tokens: the model's plain forward (logits), log-softmax in float64."""
    forward = jax.jit(lambda *args: transformer.forward(*args, model_cfg), compiler_options=QUICK_COMPILE)
    logits, _ = forward(params, bias, sequences.tokens[:, :-1], sequences.segment_ids[:, :-1])
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, sequences.tokens[:, 1:, None], axis=-1)[..., 0]
    return float(-(picked * sequences.mask).sum())


def test_one_evaluation_matches_an_independent_forward_and_the_text_bytes(corpus):
    model_cfg = load_model_config(TINY)
    plan, tokens = corpus["plan"], corpus["tokens"]
    sets = load_sequences(plan, str(tokens), 32, 5)
    params = jax.jit(lambda key: transformer.init_params(key, model_cfg), compiler_options=QUICK_COMPILE)(
        jax.random.key(3)
    )
    bias = jax.random.normal(jax.random.key(4), (model_cfg.n_layers, model_cfg.moe.n_experts)) * 0.1
    mesh = make_mesh((1, 1, 1))
    with jax.set_mesh(mesh):
        evaluator = Evaluator(model_cfg, sets, mesh, rows=2)
        records = evaluator.evaluate(params, bias, step=7, phase="pretraining", tokens_trained=123)
        again = evaluator.evaluate(params, bias, step=8)
    # One program, however many sets, batches and evaluations.
    assert sum(s.num_batches(2) for s in sets) > 2
    assert evaluator.compiled_shapes() == {"dropless": 1}
    tokenizer, _ = load_tokenizer(str(corpus["tokenizer"]))
    dropless = with_dispatch(model_cfg, "dropless")
    by_key = {(r.dispatch, r.set): r for r in records}
    for sequences in sets:
        record = by_key["dropless", sequences.name]
        nll = reference_sums(params, bias, dropless, sequences)
        scored = sequences.tokens[:, 1:][sequences.mask > 0]
        # Bytes from the original text of the documents scored, found by decoding what was scored.
        docs = tokenizer.decode(scored.tolist(), skip_special_tokens=False).split("<|endoftext|>")[:-1]
        num_bytes = sum(len(TEXTS[BY_TEXT[doc]].encode("utf-8")) for doc in docs)
        assert record.bytes == num_bytes and record.tokens == scored.size
        assert math.isclose(record.loss, nll / scored.size, rel_tol=1e-5)
        assert math.isclose(record.bits_per_byte, nll / math.log(2) / num_bytes, rel_tol=1e-5)
        assert record.drop_fraction == 0 and record.step == 7 and record.tokens_trained == 123
    averages = {r.set: r for r in records if r.kind == "average"}
    assert list(averages) == ["micro", "macro", "heldout_macro"]
    set_records = [r for r in records if r.kind != "average"]
    micro = sum(r.nll_nats for r in set_records) / math.log(2) / sum(r.bytes for r in set_records)
    assert math.isclose(averages["micro"].bits_per_byte, micro, rel_tol=1e-12)
    assert math.isclose(averages["macro"].loss, np.mean([r.loss for r in set_records]), rel_tol=1e-12)
    assert [r.loss for r in again] == [r.loss for r in records]


# --- in the training loop, and of checkpoints ---------------------------------------------------------------


def resolved_run(corpus, output: Path, **settings):
    """The tests' run of the corpus's plan: the tiny model (which trains with capacity dispatch), 4 rows."""
    from tokenmill.trainer.run.config import RunConfig, phases_from_plan, resolve_run_config, set_dotted

    plan = corpus["plan"]
    raw = {"output": str(output), "model": load_model_config(TINY).model_dump(),
           "data": {"plan": str(corpus["plan_path"]), "tokens": str(corpus["tokens"])},
           "optimizer": {"lr": 1e-2}, "schedule": {"steps": 8}, "logging": {"peak_flops": 1e9},
           "checkpoint": {"every": 4, "asynchronous": False},
           "evaluation": {"every": 2, "sequences": 3}}  # fmt: skip
    config = RunConfig.model_validate(set_dotted(raw, {k.replace("__", "."): v for k, v in settings.items()}))
    return resolve_run_config(config, phases_from_plan(plan), plan)


def source_of(corpus):
    from tokenmill.trainer.data.sampler import MixtureSource

    return MixtureSource.from_plan(corpus["plan"], "pretraining", str(corpus["tokens"]), 0)


def eval_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight_run(corpus, tmp_path_factory) -> Path:
    from tokenmill.trainer.run.loop import train

    output = tmp_path_factory.mktemp("straight") / "run"
    train(resolved_run(corpus, output), source_of(corpus))
    return output


def test_the_loop_evaluates_every_n_steps_and_at_the_end_with_both_dispatches(corpus, straight_run):
    rows = eval_rows(straight_run)
    steps = sorted({row["step"] for row in rows})
    assert steps == [2, 4, 6, 8]
    names = ["heldout/domain=notes", "heldout/domain=prose", "micro", "macro", "heldout_macro"]
    for step in steps:
        for dispatch in ("dropless", "capacity"):
            point = [r for r in rows if r["step"] == step and r["dispatch"] == dispatch]
            assert [r["set"] for r in point] == names
            assert point[0]["tokens_trained"] == step * 4 * 32 and point[0]["phase"] == "pretraining"
    # The same sequences at every point: tokens and bytes scored do not change, the loss falls.
    # Dropless drops nothing; capacity, as trained, drops some (and so scores worse or at least otherwise).
    assert all(r["drop_fraction"] == 0 for r in rows if r["dispatch"] == "dropless" and "drop_fraction" in r)
    capacity = [r for r in rows if r["dispatch"] == "capacity" and r["kind"] != "average"]
    assert any(r["drop_fraction"] > 0 for r in capacity)
    for name in names[:2]:
        mine = [r for r in rows if r["set"] == name and r["dispatch"] == "dropless"]
        assert len({(r["tokens"], r["bytes"], r["sequences"]) for r in mine}) == 1
        assert mine[-1]["loss"] < mine[0]["loss"]
    record = json.loads((straight_run / "config.json").read_text())
    latest = record["evaluation_latest"]
    final = {r["set"]: r for r in rows if r["step"] == 8 and r["dispatch"] == "dropless"}
    assert (
        latest["step"] == 8 and latest["dropless"]["heldout_macro"]["loss"] == final["heldout_macro"]["loss"]
    )
    assert record["evaluation"]["dispatch"] == "both"


def test_a_resumed_run_writes_the_same_eval_rows(corpus, straight_run, tmp_path):
    from tokenmill.trainer.run.loop import train

    output = tmp_path / "run"
    # Killed after step 6's evaluation, before any checkpoint after step 4: step 6 is evaluated again.
    train(resolved_run(corpus, output), source_of(corpus), stop_after=6)
    assert sorted({row["step"] for row in eval_rows(output)}) == [2, 4, 6]
    train(resolved_run(corpus, output), source_of(corpus))
    resumed, straight = eval_rows(output), eval_rows(straight_run)
    timing = ("seconds",)
    assert [
        {k: v for k, v in r.items() if k not in timing and not isinstance(v, float)} for r in resumed
    ] == [{k: v for k, v in r.items() if k not in timing and not isinstance(v, float)} for r in straight]
    for mine, theirs in zip(resumed, straight, strict=True):
        assert math.isclose(mine["loss"], theirs["loss"], rel_tol=1e-6)
        assert math.isclose(mine["bits_per_byte"], theirs["bits_per_byte"], rel_tol=1e-6)


def test_tokenmill_eval_repeats_the_runs_numbers_and_refuses_another_tokenizer(
    corpus, straight_run, tmp_path, capsys
):
    output = tmp_path / "step4.jsonl"
    capsys.readouterr()
    assert main(["eval", str(straight_run), "--step", "4", "--output", str(output)]) == 0
    table = capsys.readouterr().out
    assert "step 4 (pretraining)" in table and "heldout/domain=prose" in table
    mine = [json.loads(line) for line in output.read_text().splitlines()]
    theirs = [r for r in eval_rows(straight_run) if r["step"] == 4]
    assert [(r["set"], r["dispatch"], r.get("tokens"), r.get("bytes")) for r in mine] == [
        (r["set"], r["dispatch"], r.get("tokens"), r.get("bytes")) for r in theirs
    ]
    for a, b in zip(mine, theirs, strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-6), (a, b)
        assert math.isclose(a["bits_per_byte"], b["bits_per_byte"], rel_tol=1e-6)
    # One set, dropless, latest checkpoint, as JSON.
    assert main(["eval", str(straight_run), "--set", "heldout/domain=notes", "--dispatch", "dropless",
                 "--json"]) == 0  # fmt: skip
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], r["set"], r["dispatch"]) for r in printed][:1] == [
        (8, "heldout/domain=notes", "dropless")
    ]
    # Shards made with another tokenizer are refused, naming both hashes.
    other_tokenizer = tmp_path / "other.json"
    curated = corpus["root"] / "curated"
    assert main(["tokenizer", "train", "--input", str(curated), "--vocab-size", "300",
                 "--output", str(other_tokenizer)]) == 0  # fmt: skip
    other = tmp_path / "tokens"
    assert main(["tokenize", "--input", str(curated), "--output", str(other), "--tokenizer",
                 str(other_tokenizer), "--workers", "1", "--progress-seconds", "0",
                 "--heldout-fraction", "0.2"]) == 0  # fmt: skip
    _, ours = load_tokenizer(str(corpus["tokenizer"]))
    _, theirs_info = load_tokenizer(str(other_tokenizer))
    capsys.readouterr()
    assert main(["eval", str(straight_run), "--tokens", str(other)]) == 2
    error = capsys.readouterr().err
    assert ours.sha256 in error and theirs_info.sha256 in error, error


MESH_SCRIPT = """
import json
import jax, numpy as np
from tokenmill.trainer.data.batch import SyntheticSource
from tokenmill.trainer.data.evaluation import EvalSequences
from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.shape import load_model_config
from tokenmill.trainer.model.sharding import make_mesh
from tokenmill.trainer.run.evaluate import Evaluator

cfg = load_model_config(%r)
source = SyntheticSource(cfg.vocab_size, 64, 12, seed=1)
sets = []
for i in range(2):
    batch = source.batch(i)
    mask = np.ones((12, 64), np.float32)
    mask[-1, 30:] = 0  # a padded window
    sets.append(EvalSequences(f"s{i}", "heldout", batch.tokens, batch.segment_ids, mask, 1, int(mask.sum()),
                              1000, ""))
result = {}
for shape in [(1, 1, 1), (2, 2, 2)]:
    mesh = make_mesh(shape)
    with jax.set_mesh(mesh):
        params = transformer.init_params(jax.random.key(0), cfg)
        evaluator = Evaluator(cfg, sets, mesh, 8, ("dropless", "capacity"))
        records = evaluator.evaluate(params, transformer.init_router_bias(cfg), 1)
        result[str(shape)] = [[r.set, r.dispatch, r.loss] for r in records]
        result[str(shape) + "/compiled"] = evaluator.compiled_shapes()
print("RESULT " + json.dumps(result))
"""


def test_a_mesh_scores_what_one_device_scores():
    result = run_on_simulated_devices(MESH_SCRIPT % str(TINY))  # four programs that run once each
    assert result["(2, 2, 2)/compiled"] == {"dropless": 1, "capacity": 1}
    single, sharded = result["(1, 1, 1)"], result["(2, 2, 2)"]
    assert [r[:2] for r in single] == [r[:2] for r in sharded] and len(single) == 10
    for a, b in zip(single, sharded, strict=True):
        assert math.isclose(a[2], b[2], rel_tol=1e-5), (a, b)


def test_tokenmill_eval_reads_the_sets_from_gcs_as_from_disk(
    corpus, straight_run, gcs, tmp_path, monkeypatch
):
    # Evaluation sets on gs:// are mirrored locally (downloaded once); the records equal those of the disk.
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    remote_tokens = gcs.upload(corpus["tokens"], "evaluation", "tokens")
    on_disk, on_gcs = tmp_path / "disk.jsonl", tmp_path / "gcs.jsonl"
    assert main(["eval", str(straight_run), "--step", "4", "--output", str(on_disk)]) == 0
    argv = ["eval", str(straight_run), "--step", "4", "--tokens", remote_tokens, "--output", str(on_gcs)]
    assert main(argv) == 0

    def untimed(path: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in path.open()]

    assert untimed(on_gcs) == untimed(on_disk) and len(untimed(on_disk)) > 2
    # The run folder on gs:// too: its config.json and orbax checkpoint (arrays through TensorStore's GCS
    # driver), the latest step when none is given.
    remote_run = gcs.upload(straight_run, "evaluation", "run")
    from_gcs, latest = tmp_path / "from-gcs.jsonl", tmp_path / "latest.jsonl"
    argv = ["eval", remote_run, "--step", "4", "--tokens", remote_tokens, "--output", str(from_gcs)]
    assert main(argv) == 0 and untimed(from_gcs) == untimed(on_disk)
    assert main(["eval", remote_run, "--tokens", remote_tokens, "--output", str(latest)]) == 0
    assert {row["step"] for row in untimed(latest)} == {8}
    mirrored = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_symlink())
    # counts.json and the held-out slices only: no training shard is fetched.
    assert "counts.json" in mirrored and "part-00000.bytes" in mirrored
    assert len(mirrored) == 1 + sum(
        1 for p in corpus["tokens"].rglob("*") if "heldout" in p.parts and p.is_file()
    )


def test_held_out_sets_by_source_follow_the_sources_cells(corpus, tmp_path):
    """group_by: source gives one set per source of the held-out slices of the cells it draws (a cell drawn
    by two sources is in both sets, one no source draws in heldout/unsourced), whatever the weights."""
    counts = json.loads((corpus["tokens"] / "counts.json").read_text())
    prose = sorted(cell for cell in counts["cells"] if cell.startswith("domain=prose/"))
    notes = [cell for cell in counts["cells"] if cell.startswith("domain=notes/")]
    spec = tmp_path / "by-source.yaml"
    spec.write_text(
        MIXTURE.replace("group_by: domain", "group_by: source")
        .replace(
            "max_epochs: 50\n",
            "max_epochs: 50\nsources:\n  prose: domain=prose/*\n"
            f"  high: {prose[-1]}\n  notes: domain=notes/*\n",
        )
        .replace("{domain=prose/*: 0.5, domain=notes/*: 0.5}", "{prose: 0.5, notes: 0.5, high: 0}")
        .replace("{domain=prose/*: 0.2, domain=notes/*: 0.8}", "{prose: 1.0, notes: 0, high: 0}")
    )
    plan_path = tmp_path / "plan.json"
    assert main(["mixture", "plan", str(spec), "--counts", str(corpus["tokens"] / "counts.json"), "--json",
                 "--output", str(plan_path)]) == 0  # fmt: skip
    sets = {s.name: s for s in read_plan(str(plan_path)).evaluation}
    assert sorted(sets) == ["heldout/source=high", "heldout/source=notes", "heldout/source=prose"]
    assert sets["heldout/source=prose"].cells == prose and sets["heldout/source=high"].cells == [prose[-1]]
    assert sets["heldout/source=notes"].cells == notes
    by_cell = {cell: counts["cells"][cell]["heldout_tokens"] for cell in counts["cells"]}
    assert sets["heldout/source=prose"].tokens == sum(by_cell[cell] for cell in prose) > 0
    # A held-out cell no source draws forms a set of its own rather than being dropped.
    assert _heldout_groups("domain=x/quality=1", "source", {"a": {"domain=y/quality=1"}}) == [
        "heldout/unsourced"
    ]
