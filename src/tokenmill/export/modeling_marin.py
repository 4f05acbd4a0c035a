"""The Marin family (configs/models/marin-*.yaml, tiny-marin.yaml) in PyTorch, for transformers'
`trust_remote_code=True`: `tokenmill export hf` copies this file into the model folder as
modeling_tokenmill.py and points config.json's `auto_map` at it (docs/export.md).

It is tokenmill's forward (src/tokenmill/trainer/model/transformer.py) term by term: an RMSNorm (with
GatedNorm after it where the shape has one) before attention and before the MoE block, an embedding norm,
local/global layers (a window on local ones, the first `kv_heads` of the stored K/V heads per layer), plain
or learnable QK-norm times `qk_mult`, partial (optionally interleaved) rotary positions on the layers that
have them (NoPE elsewhere), exclusive self-attention (XSA), the headwise attention gate, causal depthwise
short convolutions (SConv) that never reach into another document, latent routed experts (d -> latent,
RMSNorm, SwiGLU experts, latent -> d), shared experts, a sigmoid/softmax router whose bias shifts the choice
in logit or score space, weights renormalised and scaled. The routed experts run dropless.

Parameters keep tokenmill's names and layouts ([in, out] matrices, experts stacked [E, ...]), so the
folder's tensors are the checkpoint's, per layer. Packed documents: position ids that restart at 0 start a
new document (attention and SConv stay inside it). No KV cache: every forward reads the whole sequence
(generate() with use_cache=False, which the exported generation_config sets).

This file imports only torch and transformers: it is loaded from the model folder, without tokenmill.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class TokenmillMarinConfig(PretrainedConfig):
    """The shape of a Marin-family model: tokenmill's ModelConfig fields, under their own names."""

    model_type = "tokenmill_marin"

    def __init__(self, tokenmill_model: dict | None = None, **kwargs) -> None:
        # The tokenmill shape (ModelConfig.model_dump()), every option the forward reads.
        self.tokenmill_model = tokenmill_model or {}
        shape = self.tokenmill_model
        kwargs.setdefault("vocab_size", shape.get("vocab_size"))
        kwargs.setdefault("hidden_size", shape.get("d_model"))
        kwargs.setdefault("num_hidden_layers", shape.get("n_layers"))
        kwargs.setdefault("num_attention_heads", shape.get("n_heads"))
        kwargs.setdefault("max_position_embeddings", shape.get("sequence_length"))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def _is_global(shape: dict, layer: int) -> bool:
    if shape.get("global_every"):
        return (layer + 1) % shape["global_every"] == 0 or layer == shape["n_layers"] - 1
    return layer not in (shape.get("sliding_window_layers") or [])


def _rms_norm(x: torch.Tensor, scale: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if scale is not None:
        normed = normed * scale.float()
    return normed.to(x.dtype)


class GatedNorm(nn.Module):
    """x * sigmoid(W_up silu(W_down x))."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Parameter(torch.zeros(d, rank))
        self.up = nn.Parameter(torch.zeros(rank, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(F.silu(x @ self.down) @ self.up)


def _short_conv(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over lags l of weight[l] * x[t - l]; taps before the row or in another document: none."""
    s = x.shape[1]
    out = weight[0] * x
    for lag in range(1, weight.shape[0]):
        shifted = F.pad(x, (0, 0, lag, 0))[:, :s]
        shifted_ids = F.pad(segments, (lag, 0), value=-1)[:, :s]
        out = out + weight[lag] * torch.where((shifted_ids == segments)[..., None], shifted, 0.0)
    return out


def _rotary(
    x: torch.Tensor, positions: torch.Tensor, theta: float, dims: int, interleaved: bool
) -> torch.Tensor:
    half = dims // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions[:, :, None, None].float() * freqs
    cos, sin = torch.cos(angles), torch.sin(angles)
    turning = x[..., :dims].float()
    if interleaved:
        x1, x2 = turning[..., 0::2], turning[..., 1::2]
        turned = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(turning.shape)
    else:
        x1, x2 = turning[..., :half], turning[..., half:]
        turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([turned.to(x.dtype), x[..., dims:]], dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: dict, layer: int) -> None:
        super().__init__()
        d, heads, hd = shape["d_model"], shape["n_heads"], shape["head_dim"]
        self.shape, self.layer = shape, layer
        stored = max(shape["n_kv_heads"], shape.get("global_kv_heads") or 0)
        self.stored = stored
        self.is_global = _is_global(shape, layer)
        self.kv_heads = (
            shape["global_kv_heads"]
            if self.is_global and shape.get("global_kv_heads")
            else shape["n_kv_heads"]
        )
        self.window = None if self.is_global else shape.get("sliding_window")
        self.rotary = shape.get("rope_on_global_layers", True) or not self.is_global
        self.wq = nn.Parameter(torch.zeros(d, heads * hd))
        self.wk = nn.Parameter(torch.zeros(d, stored * hd))
        self.wv = nn.Parameter(torch.zeros(d, stored * hd))
        self.wo = nn.Parameter(torch.zeros(heads * hd, d))
        if shape.get("qk_norm", True) and shape.get("qk_norm_learnable", True):
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))
        else:
            self.q_norm = self.k_norm = None
        if shape.get("attn_gate"):
            self.gate = nn.Parameter(torch.zeros(d, heads))
        sites = shape.get("sconv_sites") or []
        for site in ("k", "v"):
            if site in sites:
                setattr(self, f"sconv_{site}", nn.Parameter(torch.zeros(shape["sconv_kernel"], stored * hd)))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        shape = self.shape
        b, s, _ = x.shape
        heads, hd = shape["n_heads"], shape["head_dim"]
        eps = shape["qk_norm_eps"] if shape.get("qk_norm_eps") is not None else shape["norm_eps"]
        q = (x @ self.wq).reshape(b, s, heads, hd)
        k, v = x @ self.wk, x @ self.wv
        if hasattr(self, "sconv_k"):
            k = _short_conv(k, self.sconv_k, segments)
        if hasattr(self, "sconv_v"):
            v = _short_conv(v, self.sconv_v, segments)
        k = k.reshape(b, s, self.stored, hd)[:, :, : self.kv_heads]
        v = v.reshape(b, s, self.stored, hd)[:, :, : self.kv_heads]
        if shape.get("qk_norm", True):
            q, k = _rms_norm(q, self.q_norm, eps), _rms_norm(k, self.k_norm, eps)
        if self.rotary:
            dims = shape.get("rope_dims") or hd
            interleaved = shape.get("rope_interleaved", False)
            q = _rotary(q, positions, shape["rope_theta"], dims, interleaved)
            k = _rotary(k, positions, shape["rope_theta"], dims, interleaved)
        if shape.get("qk_mult", 1.0) != 1.0:
            q = q * shape["qk_mult"]
        group = heads // self.kv_heads
        keys, values = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        index = torch.arange(s, device=x.device)
        allowed = index[None, :] <= index[:, None]
        if self.window:
            allowed = allowed & (index[None, :] > index[:, None] - self.window)
        mask = allowed[None, None] & (segments[:, :, None] == segments[:, None, :])[:, None]
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys.float()) / math.sqrt(hd)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), values.float()).to(x.dtype)
        if shape.get("xsa"):
            along = (out * values).sum(-1, keepdim=True)
            out = out - along / ((values * values).sum(-1, keepdim=True) + 1e-6) * values
        if shape.get("attn_gate"):
            out = out * (2 * torch.sigmoid(x @ self.gate))[..., None]
        return out.reshape(b, s, heads * hd) @ self.wo


class SharedExpert(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.shared_gate = nn.Parameter(torch.zeros(d, hidden))
        self.shared_up = nn.Parameter(torch.zeros(d, hidden))
        self.shared_down = nn.Parameter(torch.zeros(hidden, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.shared_gate) * (x @ self.shared_up)) @ self.shared_down


class MoE(nn.Module):
    def __init__(self, shape: dict) -> None:
        super().__init__()
        m, d = shape["moe"], shape["d_model"]
        self.shape, self.m = shape, m
        width = m.get("latent_dim") or d
        e, h = m["n_experts"], m["expert_hidden"]
        self.router = nn.Parameter(torch.zeros(d, e))
        self.register_buffer("router_bias", torch.zeros(e), persistent=True)
        self.w_gate = nn.Parameter(torch.zeros(e, width, h))
        self.w_up = nn.Parameter(torch.zeros(e, width, h))
        self.w_down = nn.Parameter(torch.zeros(e, h, width))
        if m.get("latent_dim"):
            self.latent_down = nn.Parameter(torch.zeros(d, m["latent_dim"]))
            self.latent_norm = nn.Parameter(torch.ones(m["latent_dim"]))
            self.latent_up = nn.Parameter(torch.zeros(m["latent_dim"], d))
        shared = (m.get("n_shared_experts") or 0) * (m.get("shared_expert_hidden") or h)
        self.separate = bool(shared and m.get("separate_shared_experts"))
        if self.separate:
            hidden = m.get("shared_expert_hidden") or h
            self.shared_experts = nn.ModuleList(SharedExpert(d, hidden) for _ in range(m["n_shared_experts"]))
        elif shared:
            self.shared = SharedExpert(d, shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        logits = flat.float() @ self.router.float()
        scores = (
            torch.sigmoid(logits) if m.get("score_fn", "sigmoid") == "sigmoid" else torch.softmax(logits, -1)
        )
        unbiased = logits if m.get("bias_space", "score") == "logit" else scores
        ids = torch.topk(unbiased + self.router_bias.float(), m["top_k"], dim=-1).indices
        weights = scores.gather(1, ids)
        if m.get("normalize_weights", True):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-9)
        weights = weights * m.get("route_scale", 1.0)
        expert_in = flat
        if m.get("latent_dim"):
            expert_in = _rms_norm(flat @ self.latent_down, self.latent_norm, self.shape["norm_eps"])
        y = torch.zeros_like(expert_in)
        for expert in range(m["n_experts"]):
            token, slot = torch.where(ids == expert)
            if token.numel() == 0:
                continue
            rows = expert_in[token]
            hidden = F.silu(rows @ self.w_gate[expert]) * (rows @ self.w_up[expert])
            out = (hidden @ self.w_down[expert]) * weights[token, slot, None].to(rows.dtype)
            y = y.index_add(0, token, out)
        if m.get("latent_dim"):
            y = y @ self.latent_up
        y = y.reshape(b, s, d)
        for expert in (
            self.shared_experts if self.separate else ([self.shared] if hasattr(self, "shared") else [])
        ):
            y = y + expert(x)
        return y


class Layer(nn.Module):
    def __init__(self, shape: dict, layer: int) -> None:
        super().__init__()
        d, rank = shape["d_model"], shape.get("gated_norm_rank")
        self.eps = shape["norm_eps"]
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn = Attention(shape, layer)
        self.mlp_norm = nn.Parameter(torch.ones(d))
        self.moe = MoE(shape)
        if rank:
            self.attn_gated_norm = GatedNorm(d, rank)
            self.mlp_gated_norm = GatedNorm(d, rank)
        sites = shape.get("sconv_sites") or []
        for site in ("attn", "mlp"):
            if site in sites:
                setattr(self, f"sconv_{site}", nn.Parameter(torch.zeros(shape["sconv_kernel"], d)))

    def norm(self, x: torch.Tensor, scale: torch.Tensor, gate: str) -> torch.Tensor:
        x = _rms_norm(x, scale, self.eps)
        return getattr(self, gate)(x) if hasattr(self, gate) else x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        y = self.attn(self.norm(x, self.attn_norm, "attn_gated_norm"), positions, segments)
        if hasattr(self, "sconv_attn"):
            y = _short_conv(y, self.sconv_attn, segments)
        x = x + y
        y = self.moe(self.norm(x, self.mlp_norm, "mlp_gated_norm"))
        if hasattr(self, "sconv_mlp"):
            y = _short_conv(y, self.sconv_mlp, segments)
        return x + y


class TokenmillMarinModel(nn.Module):
    def __init__(self, shape: dict) -> None:
        super().__init__()
        d, rank = shape["d_model"], shape.get("gated_norm_rank")
        self.eps = shape["norm_eps"]
        self.embed = nn.Parameter(torch.zeros(shape["vocab_size"], d))
        if shape.get("embed_norm"):
            self.embed_norm = nn.Parameter(torch.ones(d))
            if rank:
                self.embed_gated_norm = GatedNorm(d, rank)
        self.layers = nn.ModuleList(Layer(shape, layer) for layer in range(shape["n_layers"]))
        self.final_norm = nn.Parameter(torch.ones(d))
        if rank:
            self.final_gated_norm = GatedNorm(d, rank)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens]
        if hasattr(self, "embed_norm"):
            x = _rms_norm(x, self.embed_norm, self.eps)
            if hasattr(self, "embed_gated_norm"):
                x = self.embed_gated_norm(x)
        for layer in self.layers:
            x = layer(x, positions, segments)
        x = _rms_norm(x, self.final_norm, self.eps)
        return self.final_gated_norm(x) if hasattr(self, "final_gated_norm") else x


def segments_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document ids along each row: a new document wherever the position does not follow the one before."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cumsum(starts.long(), dim=1) - 1


class TokenmillMarinForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TokenmillMarinConfig
    base_model_prefix = "model"
    _no_split_modules = ["Layer"]
    # The router and its bias stay fp32 under a bf16 load, as tokenmill runs them: a rounded bias would
    # change which experts tokens choose.
    _keep_in_fp32_modules_strict = ["moe.router"]

    def __init__(self, config: TokenmillMarinConfig) -> None:
        super().__init__(config)
        shape = config.tokenmill_model
        self.model = TokenmillMarinModel(shape)
        self.lm_head = nn.Parameter(torch.zeros(shape["d_model"], shape["vocab_size"]))
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Every weight comes from the folder; nothing is drawn.
        pass

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        else:
            position_ids = position_ids.expand(b, s)
        segments = segments_from_positions(position_ids)
        # RoPE sees only differences of positions inside a document: the row's own index serves.
        index = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        hidden = self.model(input_ids, index, segments)
        logits = (hidden @ self.lm_head).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, **kwargs) -> dict:
        # No cache: the whole sequence every step.
        return {"input_ids": input_ids}
