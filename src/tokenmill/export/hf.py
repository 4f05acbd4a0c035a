"""Hugging Face model folders: a tokenmill checkpoint written as one, and read back (docs/export.md).

The DeepSeek-style family (configs/models/tiny.yaml, dsv3-*) maps onto transformers' stock
`Dots1ForCausalLM` (model_type "dots1"), whose forward is tokenmill's term by term: pre-norm RMSNorm
blocks, grouped-query attention with per-head RMSNorm on q and k before rotary positions that pair channel
i with i + head_dim/2, a sliding window on the layers `layer_types` names (window w: a query sees itself
and the w - 1 keys before it, as tokenmill's), a sigmoid router whose bias (`e_score_correction_bias`)
shifts only the choice of the top-k experts, weights renormalised and scaled by `routed_scaling_factor`,
SwiGLU experts, and one shared SwiGLU (tokenmill's shared experts side by side) added to every token.
Glm4Moe has no sliding window and DeepseekV3 attends through low-rank latent K/V (MLA), so neither
expresses these shapes exactly; docs/export.md says more.

Every model option `Dots1ForCausalLM` cannot express is refused by `unsupported_options`, naming the option,
never dropped. The Marin family, which uses most of those options, goes through the PyTorch modeling file
tokenmill ships (export/modeling_marin.py, copied into the folder as modeling_tokenmill.py and named in
config.json's `auto_map`; loaded with trust_remote_code=True): its tensors keep tokenmill's names and
layouts, one set per layer, experts stacked (`marin_specs`). Training-only options (the balancing rule
and rate, capacity, the auxiliary losses, init, remat, blocking) do not change the forward and are kept
only in the export record. transformers runs the routed experts dropless: its logits equal tokenmill's
forward with `moe.dispatch: dropless`, the dispatch tokenmill evaluates with.

Tensor names and layouts (tokenmill stores x @ W, [in, out]; torch's Linear stores [out, in]):
`model.embed_tokens.weight` = embed [V, D]; per layer i, `input_layernorm` = attn_norm,
`self_attn.{q,k,v,o}_proj.weight` = w{q,k,v,o}^T, `self_attn.{q,k}_norm.weight` = {q,k}_norm (ones when the
norm has no scale), `post_attention_layernorm` = mlp_norm, `mlp.gate.weight` = router^T [E, D],
`mlp.gate.e_score_correction_bias` = router_bias[i], `mlp.experts.{e}.{gate,up,down}_proj.weight` =
w_{gate,up,down}[e]^T (the stacked bank split per expert, the on-disk layout transformers merges on load),
`mlp.shared_experts.{gate,up,down}_proj.weight` = the shared experts' matrices^T, concatenated along their
hidden axis; `model.norm.weight` = final_norm; `lm_head.weight` = lm_head^T [V, D].
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenmill import __version__, storage
from tokenmill.export.run import ExportError, RunCheckpoint
from tokenmill.export.tensors import DEFAULT_SHARD_BYTES, TensorSpec, read_folder_tensors, write_sharded
from tokenmill.trainer.model.shape import ModelConfig

log = logging.getLogger(__name__)

RECORD = "tokenmill_export.json"
RECORD_FORMAT = 1
CONFIG = "config.json"
ARCHITECTURE = "Dots1ForCausalLM"
MODEL_TYPE = "dots1"
# The Marin family's class: export/modeling_marin.py, copied into the folder under this name.
MARIN_ARCHITECTURE = "TokenmillMarinForCausalLM"
MARIN_MODULE = "modeling_tokenmill"
ARCHITECTURES = ("auto", "dots1", "tokenmill")


def unsupported_options(cfg: ModelConfig) -> list[str]:
    """Each model option of `cfg` that Dots1ForCausalLM cannot express, as 'option: value (why)'."""
    m = cfg.moe
    problems = []

    def refuse(option: str, value: Any, why: str) -> None:
        problems.append(f"{option}: {value} ({why})")

    if m.score_fn != "sigmoid":
        refuse("moe.score_fn", m.score_fn, "Dots1's router scores with a sigmoid")
    if m.bias_space != "score":
        refuse(
            "moe.bias_space", m.bias_space, "Dots1 adds the router bias to the sigmoid scores, not the logits"
        )
    if m.latent_dim:
        refuse("moe.latent_dim", m.latent_dim, "Dots1's experts read the full-width token")
    if m.shared_hidden_total == 0:
        refuse("moe.n_shared_experts", m.n_shared_experts, "Dots1 always has a shared expert")
    elif m.shared_hidden_total % m.expert_hidden:
        refuse(
            "moe.shared_expert_hidden",
            m.shared_expert_hidden,
            "Dots1's shared width is a multiple of moe_intermediate_size (moe.expert_hidden)",
        )
    if cfg.global_kv_heads is not None and cfg.global_kv_heads != cfg.n_kv_heads:
        refuse("global_kv_heads", cfg.global_kv_heads, "Dots1 has one KV head count for every layer")
    if cfg.rope_dims is not None and cfg.rope_dims != cfg.head_dim:
        refuse("rope_dims", cfg.rope_dims, "Dots1 rotates every channel of a head")
    if cfg.rope_interleaved:
        refuse("rope_interleaved", True, "Dots1 pairs channel i with i + head_dim/2")
    if not cfg.rope_on_global_layers and any(cfg.is_global(i) for i in range(cfg.n_layers)):
        refuse("rope_on_global_layers", False, "Dots1 applies rotary positions on every layer")
    if not cfg.qk_norm:
        refuse("qk_norm", False, "Dots1 always normalises q and k")
    if cfg.qk_eps != cfg.norm_eps:
        refuse("qk_norm_eps", cfg.qk_norm_eps, "Dots1's q/k norm uses rms_norm_eps (norm_eps)")
    if cfg.qk_mult != 1.0:
        refuse("qk_mult", cfg.qk_mult, "Dots1 scales attention logits by 1/sqrt(head_dim) only")
    if cfg.embed_norm:
        refuse("embed_norm", True, "Dots1 has no norm on the embeddings")
    if cfg.gated_norm_rank:
        refuse("gated_norm_rank", cfg.gated_norm_rank, "Dots1 has no GatedNorm")
    if cfg.xsa:
        refuse("xsa", True, "Dots1 has no exclusive self-attention")
    if cfg.attn_gate:
        refuse("attn_gate", True, "Dots1 has no attention output gate")
    if cfg.sconv_sites:
        refuse("sconv_sites", cfg.sconv_sites, "Dots1 has no short convolutions")
    return problems


def check_exportable(cfg: ModelConfig) -> None:
    """Raise ExportError naming every option of `cfg` that the target class cannot express."""
    problems = unsupported_options(cfg)
    if problems:
        raise ExportError(
            f"model {cfg.name!r} cannot be exported as {ARCHITECTURE} without changing what it computes: "
            + "; ".join(problems)
        )


def hf_config(cfg: ModelConfig, eos_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of the export (Dots1Config's fields)."""
    m = cfg.moe
    layer_types = [
        "full_attention" if cfg.window(layer) is None else "sliding_attention"
        for layer in range(cfg.n_layers)
    ]
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.sequence_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "rope_theta": float(cfg.rope_theta),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "sliding_window": cfg.sliding_window if "sliding_attention" in layer_types else None,
        "layer_types": layer_types,
        "n_routed_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_hidden,
        # The dense MLP of layers below first_k_dense_replace; every layer is MoE here, so it is unused.
        "intermediate_size": m.expert_hidden,
        "first_k_dense_replace": 0,
        "n_shared_experts": m.shared_hidden_total // m.expert_hidden,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": m.normalize_weights,
        "routed_scaling_factor": float(m.route_scale),
        "tie_word_embeddings": False,
        "initializer_range": cfg.weight_std,
        "use_cache": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": "bfloat16" if dtype == "bf16" else "float32",
    }


def _layer(params: dict, cfg: ModelConfig, layer: int) -> dict:
    from tokenmill.trainer.model.transformer import layer_params

    return layer_params(params, cfg, layer)


def _shared(moe: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shared experts as one SwiGLU (gate, up [D, S], down [S, D]): separate ones side by side."""
    experts = moe.get("shared_experts", [moe])
    gate = np.concatenate([e["shared_gate"] for e in experts], axis=1)
    up = np.concatenate([e["shared_up"] for e in experts], axis=1)
    down = np.concatenate([e["shared_down"] for e in experts], axis=0)
    return gate, up, down


def tensor_specs(params: dict, router_bias: np.ndarray, cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the folder, in order, each made (transposed, split) only when its shard is written."""
    d, m = cfg.d_model, cfg.moe
    heads, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, d), lambda: params["embed"])]

    def add(name: str, shape: tuple[int, ...], make: Callable[[], np.ndarray], fp32: bool = False) -> None:
        specs.append(TensorSpec(name, shape, make, fp32))

    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."

        def get(*path: Any, i: int = i) -> np.ndarray:
            node = _layer(params, cfg, i)
            for key in path:
                node = node[key]
            return node

        add(p + "input_layernorm.weight", (d,), lambda get=get: get("attn_norm"))
        add(p + "self_attn.q_proj.weight", (heads * hd, d), lambda get=get: get("attn", "wq").T)
        add(p + "self_attn.k_proj.weight", (kv * hd, d), lambda get=get: get("attn", "wk").T)
        add(p + "self_attn.v_proj.weight", (kv * hd, d), lambda get=get: get("attn", "wv").T)
        add(p + "self_attn.o_proj.weight", (d, heads * hd), lambda get=get: get("attn", "wo").T)
        for which in ("q", "k"):
            add(
                p + f"self_attn.{which}_norm.weight",
                (hd,),
                lambda get=get, which=which: (
                    get("attn", f"{which}_norm") if cfg.qk_norm_learnable else np.ones((hd,), np.float32)
                ),
            )
        add(p + "post_attention_layernorm.weight", (d,), lambda get=get: get("mlp_norm"))
        add(p + "mlp.gate.weight", (m.n_experts, d), lambda get=get: get("moe", "router").T, True)
        add(p + "mlp.gate.e_score_correction_bias", (m.n_experts,), lambda i=i: router_bias[i], True)
        for e in range(m.n_experts):
            q = p + f"mlp.experts.{e}."
            h = m.expert_hidden
            add(q + "gate_proj.weight", (h, d), lambda get=get, e=e: get("moe", "w_gate")[e].T)
            add(q + "up_proj.weight", (h, d), lambda get=get, e=e: get("moe", "w_up")[e].T)
            add(q + "down_proj.weight", (d, h), lambda get=get, e=e: get("moe", "w_down")[e].T)
        s = m.shared_hidden_total
        for index, (name, shape) in enumerate(
            (("gate_proj", (s, d)), ("up_proj", (s, d)), ("down_proj", (d, s)))
        ):
            add(
                p + f"mlp.shared_experts.{name}.weight",
                shape,
                lambda get=get, index=index: _shared(get("moe"))[index].T,
            )
    add("model.norm.weight", (d,), lambda: params["final_norm"])
    add("lm_head.weight", (cfg.vocab_size, d), lambda: params["lm_head"].T)
    return specs


def params_from_tensors(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> tuple[dict, np.ndarray]:
    """The inverse of `tensor_specs`: tokenmill's parameters (layers stacked by group) and router bias."""
    m = cfg.moe

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ExportError(f"the folder has no tensor {name}")
        return np.asarray(tensors[name], np.float32)

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        attn = {key: take(p + f"self_attn.{name}_proj.weight").T for key, name in
                (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))}  # fmt: skip
        if cfg.qk_norm_learnable:
            attn["q_norm"] = take(p + "self_attn.q_norm.weight")
            attn["k_norm"] = take(p + "self_attn.k_norm.weight")
        experts = range(m.n_experts)
        moe = {
            "router": take(p + "mlp.gate.weight").T,
            "w_gate": np.stack([take(p + f"mlp.experts.{e}.gate_proj.weight").T for e in experts]),
            "w_up": np.stack([take(p + f"mlp.experts.{e}.up_proj.weight").T for e in experts]),
            "w_down": np.stack([take(p + f"mlp.experts.{e}.down_proj.weight").T for e in experts]),
        }
        gate, up, down = (take(p + f"mlp.shared_experts.{n}_proj.weight").T for n in ("gate", "up", "down"))
        if m.separate_shared_experts:
            width = m.shared_expert_hidden
            moe["shared_experts"] = [
                {
                    "shared_gate": gate[:, j * width : (j + 1) * width],
                    "shared_up": up[:, j * width : (j + 1) * width],
                    "shared_down": down[j * width : (j + 1) * width],
                }
                for j in range(m.n_shared_experts)
            ]
        else:
            moe.update(shared_gate=gate, shared_up=up, shared_down=down)
        return {
            "attn_norm": take(p + "input_layernorm.weight"),
            "attn": attn,
            "mlp_norm": take(p + "post_attention_layernorm.weight"),
            "moe": moe,
        }

    layers = [layer(i) for i in range(cfg.n_layers)]
    stacked = [
        [
            _stack([layers[group.layer(r, position)] for r in range(group.repeats)])
            for position in range(group.period)
        ]
        for group in cfg.layer_groups()
    ]
    params = {
        "embed": take("model.embed_tokens.weight"),
        "layers": stacked,
        "final_norm": take("model.norm.weight"),
        "lm_head": take("lm_head.weight").T,
    }
    bias = np.stack([take(f"model.layers.{i}.mlp.gate.e_score_correction_bias") for i in range(cfg.n_layers)])
    return params, bias.astype(np.float32)


def _stack(trees: list) -> Any:
    """Trees of one structure stacked leaf by leaf along a new first axis."""
    first = trees[0]
    if isinstance(first, dict):
        return {key: _stack([tree[key] for tree in trees]) for key in first}
    if isinstance(first, list):
        return [_stack([tree[j] for tree in trees]) for j in range(len(first))]
    return np.ascontiguousarray(np.stack(trees))


# --- the Marin family: tokenmill's own names and layouts, through the shipped modeling file ---------------


def marin_config(cfg: ModelConfig, eos_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of a folder that modeling_tokenmill.py (export/modeling_marin.py) reads."""
    return {
        "architectures": [MARIN_ARCHITECTURE],
        "model_type": "tokenmill_marin",
        "auto_map": {
            "AutoConfig": f"{MARIN_MODULE}.TokenmillMarinConfig",
            "AutoModelForCausalLM": f"{MARIN_MODULE}.{MARIN_ARCHITECTURE}",
        },
        "tokenmill_model": cfg.model_dump(mode="json"),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "max_position_embeddings": cfg.sequence_length,
        "tie_word_embeddings": False,
        "use_cache": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "dtype": "bfloat16" if dtype == "bf16" else "float32",
    }


def _flatten(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    """(dotted name, leaf) of a nested dict/list tree; the fused shared experts sit under `shared`."""
    if isinstance(tree, dict):
        found = []
        # Only the MoE block's own fused shared experts (it has the router); separate ones keep their names.
        fused = "router" in tree
        shared = {key for key in ("shared_gate", "shared_up", "shared_down") if fused and key in tree}
        for key, value in tree.items():
            name = f"{prefix}shared.{key}" if key in shared else f"{prefix}{key}"
            found += _flatten(value, name + ".") if isinstance(value, dict | list) else [(name, value)]
        return found
    return [item for index, value in enumerate(tree) for item in _flatten(value, f"{prefix}{index}.")]


def marin_specs(params: dict, router_bias: np.ndarray, cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor under the names the modeling file's modules give them, in tokenmill's layouts."""
    specs = [
        TensorSpec(f"model.{name}", np.shape(leaf), lambda leaf=leaf: leaf)
        for name, leaf in _flatten({k: v for k, v in params.items() if k not in ("layers", "lm_head")}, "")
    ]
    for i in range(cfg.n_layers):
        layer = _layer(params, cfg, i)
        specs += [
            TensorSpec(
                f"model.layers.{i}.{name}", np.shape(leaf), lambda leaf=leaf: leaf, name == "moe.router"
            )
            for name, leaf in _flatten(layer, "")
        ]
        specs.append(
            TensorSpec(
                f"model.layers.{i}.moe.router_bias", (cfg.moe.n_experts,), lambda i=i: router_bias[i], True
            )
        )
    specs.append(TensorSpec("lm_head", np.shape(params["lm_head"]), lambda: params["lm_head"]))
    return specs


def marin_params_from_tensors(tensors: dict[str, np.ndarray], cfg: ModelConfig) -> tuple[dict, np.ndarray]:
    """The inverse of `marin_specs`, onto the parameter layout init_params gives the shape."""
    import jax

    from tokenmill.trainer.model.transformer import init_params

    abstract = jax.eval_shape(lambda key: init_params(key, cfg), jax.random.key(0))

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise ExportError(f"the folder has no tensor {name}")
        return np.asarray(tensors[name], np.float32)

    def fill(template: Any, prefix: str) -> Any:
        names = dict(_flatten(template, prefix))
        leaves = iter(take(name) for name in names)
        return jax.tree.map(lambda _: next(leaves), template)

    params = fill({k: v for k, v in abstract.items() if k not in ("layers", "lm_head")}, "model.")
    params["lm_head"] = take("lm_head")
    params["layers"] = [
        [
            _stack(
                [
                    fill(abstract["layers"][g][p], f"model.layers.{group.layer(r, p)}.")
                    for r in range(group.repeats)
                ]
            )
            for p in range(group.period)
        ]
        for g, group in enumerate(cfg.layer_groups())
    ]
    bias = np.stack([take(f"model.layers.{i}.moe.router_bias") for i in range(cfg.n_layers)])
    return params, bias


def marin_modeling_source() -> bytes:
    """The bytes of export/modeling_marin.py, which the folder holds as modeling_tokenmill.py."""
    from importlib import resources

    return resources.files("tokenmill.export").joinpath("modeling_marin.py").read_bytes()


# --- the folder -----------------------------------------------------------------------------------------


def check_output(output: str, overwrite: bool) -> None:
    """Refuse an output folder that holds files (another export or anything else); `overwrite` removes an
    earlier export (a folder with an export record) and nothing else."""
    if not storage.is_dir_nonempty(output):
        return
    record = storage.join(output, RECORD)
    if storage.exists(record):
        try:
            previous = storage.read_json(record)
            what = f"an export of {previous.get('run')} at step {previous.get('step')}"
        except (OSError, ValueError):
            what = "an export"
    else:
        what = "files"
    if not overwrite:
        raise ExportError(
            f"{output} already holds {what}: give another --output, or --overwrite to replace it"
        )
    if not storage.exists(record):
        # A run folder has a config.json too: only a folder with an export record is ever removed.
        raise ExportError(f"{output} holds files but no export record: --overwrite replaces only an export")
    storage.remove_tree(output)


def tokenizer_files(tokenizer_path: str, cfg: ModelConfig) -> tuple[dict[str, bytes], int, str, dict]:
    """The tokenizer's files for the folder ({name: bytes}), its end-of-text id and token, its description."""
    import json

    from tokenmill.tokenize.tokenizer import TokenizerError, load_tokenizer, read_tokenizer_bytes

    try:
        _, info = load_tokenizer(tokenizer_path)
    except TokenizerError as error:
        raise ExportError(str(error)) from error
    if info.vocab_size > cfg.vocab_size:
        raise ExportError(
            f"{tokenizer_path}: {info.vocab_size} tokens, more than the model's vocab_size {cfg.vocab_size}"
        )

    def text(value: dict) -> bytes:
        return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()

    special = {"eos_token": info.eos_token, "bos_token": info.eos_token, "pad_token": info.eos_token}
    files = {
        "tokenizer.json": read_tokenizer_bytes(tokenizer_path),
        "tokenizer_config.json": text(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **special,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": cfg.sequence_length,
            }
        ),
        "special_tokens_map.json": text(special),
    }
    description = {"name": info.name, "sha256": info.sha256, "vocab_size": info.vocab_size}
    return files, info.eos_id, info.eos_token, description


def export_hf(
    checkpoint: RunCheckpoint,
    output: str,
    dtype: str = "fp32",
    tokenizer_path: str | None = None,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    eos_id: int | None = None,
    architecture: str = "auto",
) -> dict[str, Any]:
    """Write `checkpoint` as a Hugging Face model folder at `output` (local or gs://); returns the export
    record (also written, last, as tokenmill_export.json).

    Tensors go first, shard by shard, then config.json, generation_config.json, the tokenizer's files and the
    record with every file's sha256: a folder with a record is complete. A tokenizer whose sha256 differs from
    the one the run trained with is refused. Without a tokenizer (a synthetic run) the folder has none and
    `eos_id` (default: the synthetic source's 0) is the end-of-text id.

    `architecture`: "dots1" (transformers' stock class; an option it cannot express is refused by name),
    "tokenmill" (the modeling file shipped with tokenmill, trust_remote_code=True; every option), or "auto":
    dots1 where it expresses the model, else tokenmill's file (the Marin family)."""
    from tokenmill.trainer.run.checkpoint import canonical_sha256, model_record

    cfg = checkpoint.model
    if architecture not in ARCHITECTURES:
        raise ExportError(f"architecture {architecture!r}: one of {', '.join(ARCHITECTURES)}")
    if architecture == "auto":
        architecture = "tokenmill" if unsupported_options(cfg) else "dots1"
    if architecture == "dots1":
        check_exportable(cfg)
    check_output(output, overwrite)
    files: dict[str, bytes] = {}
    tokenizer = None
    if tokenizer_path is not None:
        files, eos_id, _, tokenizer = tokenizer_files(tokenizer_path, cfg)
        trained = checkpoint.tokenizer_sha256
        if trained and trained != tokenizer["sha256"]:
            raise ExportError(
                f"{tokenizer_path} has sha256 {tokenizer['sha256'][:12]}, but the run trained with tokenizer "
                f"sha256 {trained[:12]}: give the tokenizer.json the run's tokens were made with"
            )
    elif checkpoint.tokenizer_sha256:
        raise ExportError(
            f"the run trained with tokenizer sha256 {checkpoint.tokenizer_sha256[:12]}: give its "
            "tokenizer.json with --tokenizer"
        )
    elif eos_id is None:
        eos_id = 0
    storage.make_dirs(output)
    stock = architecture == "dots1"
    specs = (tensor_specs if stock else marin_specs)(checkpoint.params, checkpoint.router_bias, cfg)
    written = write_sharded(specs, output, dtype, shard_bytes)
    generation = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}
    if not stock:
        # The shipped class keeps no KV cache: generate() reruns the whole sequence each step.
        generation["use_cache"] = False
        files[f"{MARIN_MODULE}.py"] = marin_modeling_source()
    config = hf_config(cfg, eos_id, dtype) if stock else marin_config(cfg, eos_id, dtype)
    storage.write_json(storage.join(output, CONFIG), config)
    storage.write_json(storage.join(output, "generation_config.json"), generation)
    for name, data in files.items():
        storage.write_bytes(storage.join(output, name), data)
    names = sorted([*written, CONFIG, "generation_config.json", *files])
    record = {
        "format_version": RECORD_FORMAT,
        "tokenmill_version": __version__,
        "architecture": ARCHITECTURE if stock else MARIN_ARCHITECTURE,
        "run": checkpoint.run_dir,
        "step": checkpoint.step,
        "phase": checkpoint.meta.get("phase"),
        "tokens_trained": checkpoint.meta.get("tokens"),
        "plan_sha256": checkpoint.plan_sha256,
        "config_sha256": checkpoint.config_sha256,
        "model_sha256": checkpoint.model_sha256 or canonical_sha256(model_record(cfg)),
        "model": cfg.model_dump(mode="json"),
        "dtype": dtype,
        "eos_id": eos_id,
        "tokenizer": tokenizer,
        "files": {name: storage.file_sha256(storage.join(output, name)) for name in names},
    }
    storage.write_json(storage.join(output, RECORD), record)
    log.info(
        "exported %s step %d to %s (%d files)", checkpoint.run_dir, checkpoint.step, output, len(names) + 1
    )
    return record


def import_hf(folder: str, verify: bool = True) -> tuple[ModelConfig, dict, np.ndarray, dict[str, Any]]:
    """(model shape, parameters, router bias, export record) of a folder `export_hf` wrote. `verify` checks
    every file's sha256 against the record first. Parameters come back as float32 (a bf16 export's values
    widened)."""
    record_path = storage.join(folder, RECORD)
    if not storage.exists(record_path):
        raise ExportError(f"{folder}: no {RECORD} (not a folder `tokenmill export hf` wrote)")
    record = storage.read_json(record_path)
    if verify:
        for name, sha256 in record["files"].items():
            found = storage.file_sha256(storage.join(folder, name))
            if found != sha256:
                raise ExportError(
                    f"{folder}/{name}: sha256 {found[:12]}, the export record says {sha256[:12]}"
                )
    cfg = ModelConfig.model_validate(record["model"])
    read = (
        params_from_tensors
        if record.get("architecture", ARCHITECTURE) == ARCHITECTURE
        else marin_params_from_tensors
    )
    params, bias = read(dict(read_folder_tensors(folder)), cfg)
    return cfg, params, bias, record
