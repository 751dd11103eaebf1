#!/usr/bin/env python3
"""PyTorch baseline for m3's layer benchmark (SPEC §9).

SPEC §9 reports, side by side, the time of one decode step of one MiniMax-M3
layer on m3's stock path, on its fused (mono) path, and on a plain PyTorch
implementation of the same layer on the same weights. This script is that
PyTorch column. It loads only layer L of a checkpoint folder (bf16; MXFP8 is
refused), builds K/V and index caches for `rows` sequences of `context`
tokens, and times one decode step (one new token per sequence, at position
context-1) implementing SPEC §2.3 and §3 with ordinary PyTorch ops:

    add + Gemma RMSNorm -> fused q/k/v(/index q/k) projection -> per-head norm
    + NeoX RoPE -> cache write -> [sparse layers] index block scores, top-k
    block selection, attention over the selected blocks | [dense layers]
    attention over the whole context -> o_proj -> add + post norm ->
    MoE (fp32 sigmoid router, routed experts, shared expert) | dense MLP

Modes:
  eager  plain calls; the MoE loops over the experts the rows chose (one host
         sync to learn them), as a typical PyTorch MoE does.
  graph  the same step captured in a torch.cuda.CUDAGraph per input set. A
         graph cannot loop over data-dependent experts, so the MoE runs on
         stacked [E, 2I, H] / [E, H, I] expert weights built at load:
         `grouped` (default on CUDA): torch._grouped_mm over the rows sorted
         by expert, group offsets computed on the device; experts nobody
         chose are empty groups and are not read. `gather` (--graph-moe
         gather): index_select of the chosen experts' weights + batched
         GEMVs (gpt-fast style); reads only chosen experts, but copies them
         and reads an expert once per (row, slot). Measured on an H200 at
         rows 16: grouped ~1.0 ms, gather ~1.8 ms per step.

The caches are contiguous per sequence, not paged: K/V [rows, kv_heads,
context, head_dim] and index keys [rows, context, index_dim], bf16, random
O(1) values. Several such input sets (hidden, residual, caches) are built and
cycled between iterations so their total exceeds the H200's L2 cache and
repeated steps do not measure L2 hits.

Bytes per step follow SPEC §9: the attention weights (with norms), the router,
the experts the rows actually route to (unique per step), the shared expert or
the dense MLP, the index cache over every visible block, and K/V of the
selected blocks (all of K/V on dense layers). GB/s = bytes / median time.

Usage:
  python3 bench/torch_layer.py --model DIR --layer L --rows 1,2,4,8,16 \\
      --context 4096,32768,131072 [--modes eager,graph] [--iters N] \\
      [--json OUT.json] [--device cuda]
  python3 bench/torch_layer.py --model DIR --layer L --check [--device cpu]

--check runs the step once at a small size on the loaded layer and compares
eager vs graph outputs (on a CPU, where graphs do not exist, the graph-mode
MoE formulation run eagerly) and both against a slow, independent per-row
reference of SPEC §2.3; relative L2 must be <= 1e-2. It exits 0 on pass.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BF16 = torch.bfloat16
F32 = torch.float32
LOG2E = 1.4426950408889634
L2_BYTES = 60 << 20  # H200 L2 is ~60 MB; input sets together must exceed it
TOL = 1e-2


def die(msg):
    print(f"torch_layer: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------
# config.json (both spellings, as src/model/config.c reads them)
# ----------------------------------------------------------------------------

def _first(obj, names, default=None, required=False):
    for n in names:
        if isinstance(obj, dict) and obj.get(n) is not None:
            return obj[n]
    if required:
        die(f"config.json: missing required field '{names[0]}'")
    return default


class Config:
    def __init__(self, model_dir):
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                root = json.load(f)
        except (OSError, ValueError) as e:
            die(f"cannot read {path}: {e}")
        t = root.get("text_config") or root
        q = t.get("quantization_config") or root.get("quantization_config")
        if q:
            die(f"{path}: quantization_config ({q.get('quant_method', '?')}) is not supported by "
                "this baseline: it runs bf16 checkpoints only (MXFP8 would need a dequantize or "
                "an fp8 GEMM path, which would not be the same baseline)")
        self.H = int(_first(t, ["hidden_size"], required=True))
        self.layers = int(_first(t, ["num_hidden_layers"], required=True))
        self.Hq = int(_first(t, ["num_attention_heads"], required=True))
        self.KVH = int(_first(t, ["num_key_value_heads"], required=True))
        self.D = int(_first(t, ["head_dim"], self.H // self.Hq))
        rp = t.get("rope_parameters") or {}
        factor = _first(t, ["partial_rotary_factor"], _first(rp, ["partial_rotary_factor"], 1.0))
        self.R = int(_first(t, ["rotary_dim"], round(float(factor) * self.D)))
        self.theta = float(_first(t, ["rope_theta"], _first(rp, ["rope_theta"], 5000000.0)))
        self.eps = float(_first(t, ["rms_norm_eps"], 1e-6))
        if self.Hq % self.KVH or self.R % 2 or self.R > self.D:
            die(f"{path}: unsupported head geometry (heads {self.Hq}, kv heads {self.KVH}, "
                f"rotary_dim {self.R}, head_dim {self.D})")

        # sparse attention: the released object or the flattened index_* fields
        sc = t.get("sparse_attention_config")
        s = sc if isinstance(sc, dict) else t
        freq = s.get("sparse_attention_freq")
        types = t.get("layer_types")
        if freq is not None:
            self.sparse = [bool(v) for v in freq]
        elif types is not None:
            self.sparse = [v in ("minimax_m3_sparse", "sparse_attention") for v in types]
        else:
            self.sparse = [False] * self.layers
        if not _first(s, ["use_sparse_attention"], True):
            self.sparse = [False] * self.layers
        self.block = int(_first(s, ["sparse_block_size", "index_block_size"], 128))
        if self.block != 128:
            die(f"{path}: sparse_block_size = {self.block} is not supported (128)")
        if any(self.sparse):
            self.NI = int(_first(s, ["sparse_num_index_heads", "index_n_heads"], required=True))
            self.Di = int(_first(s, ["sparse_index_dim", "index_head_dim"], required=True))
            self.topk = int(_first(s, ["sparse_topk_blocks", "index_topk_blocks"], required=True))
            self.init_blocks = int(_first(s, ["sparse_init_block", "index_init_blocks"], 0))
            self.local_blocks = int(_first(s, ["sparse_local_block", "index_local_blocks"], 1))
            if self.NI != self.KVH:
                die(f"{path}: sparse_num_index_heads = {self.NI} must equal num_key_value_heads "
                    f"= {self.KVH} (each index head selects for its KV group)")
            if self.Di != self.D:
                die(f"{path}: sparse_index_dim {self.Di} != head_dim {self.D} is not supported by "
                    "this baseline (it norms and rotates all heads as one tensor)")
        else:
            self.NI = self.Di = self.topk = self.init_blocks = self.local_blocks = 0

        # FFN: moe_layer_freq or mlp_layer_types; Hugging Face default: all MoE
        mf = t.get("moe_layer_freq")
        mt = t.get("mlp_layer_types")
        if mf is not None:
            self.moe = [bool(v) for v in mf]
        elif mt is not None:
            self.moe = [v in ("sparse", "moe") for v in mt]
        else:
            self.moe = [True] * self.layers
        if len(self.sparse) != self.layers or len(self.moe) != self.layers:
            die(f"{path}: per-layer lists do not have {self.layers} entries")
        self.dense_dim = int(_first(t, ["dense_intermediate_size", "mlp_intermediate_size"], 0))
        self.I = int(_first(t, ["intermediate_size", "moe_intermediate_size"], 0))
        self.E = int(_first(t, ["num_local_experts", "n_routed_experts"], 0))
        self.K = int(_first(t, ["num_experts_per_tok"], 0))
        shared = int(_first(t, ["shared_intermediate_size"], 0))
        n_shared = int(_first(t, ["n_shared_experts", "num_shared_experts"], 1 if shared else 0))
        if n_shared > 1:
            die(f"{path}: n_shared_experts = {n_shared} is not supported (0 or 1)")
        self.Is = shared if n_shared else 0
        sf = _first(t, ["scoring_func"], "sigmoid")
        if any(self.moe) and sf != "sigmoid":
            die(f"{path}: scoring_func = {sf} is not supported (sigmoid)")
        self.use_bias = bool(_first(t, ["use_routing_bias"], True))
        self.rsf = float(_first(t, ["routed_scaling_factor"], 1.0))
        self.alpha = float(_first(t, ["swiglu_alpha"], 1.702))
        self.limit = float(_first(t, ["swiglu_limit"], 7.0))


# ----------------------------------------------------------------------------
# Loading layer L only
# ----------------------------------------------------------------------------

class Checkpoint:
    """Name -> shard file, from model.safetensors.index.json or the shards'
    own headers; tensors are read one at a time (safe_open maps the file, so
    only the bytes of layer L are touched)."""

    PREFIXES = ["language_model.model.", "model.language_model.", "model.", ""]

    def __init__(self, model_dir, layer):
        try:
            from safetensors import safe_open
        except ImportError:
            die("the 'safetensors' package is needed (pip install safetensors)")
        self.safe_open = safe_open
        self.dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
        else:
            files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
            if not files:
                die(f"{model_dir}: no model.safetensors.index.json and no *.safetensors files")
            self.where = {}
            for fn in files:
                with safe_open(os.path.join(model_dir, fn), framework="pt") as h:
                    for k in h.keys():
                        self.where[k] = fn
        self.prefix = None
        for p in self.PREFIXES:
            if f"{p}layers.{layer}.input_layernorm.weight" in self.where:
                self.prefix = p
                break
        if self.prefix is None:
            die(f"{model_dir}: no tensor layers.{layer}.input_layernorm.weight under any of the "
                f"prefixes {self.PREFIXES}")
        self.handles = {}

    def has(self, suffix):
        return self.prefix + suffix in self.where

    def _handle(self, fn):
        if fn not in self.handles:
            self.handles[fn] = self.safe_open(os.path.join(self.dir, fn), framework="pt")
        return self.handles[fn]

    def get(self, suffix, shape, dtype):
        name = self.prefix + suffix
        if name not in self.where:
            die(f"checkpoint is missing tensor {name}")
        h = self._handle(self.where[name])
        sl = h.get_slice(name)
        dt = sl.get_dtype()
        if dt.startswith("F8") or name + "_scale_inv" in self.where:
            die(f"tensor {name} is {dt} (MXFP8): this baseline runs bf16 checkpoints only")
        got = list(sl.get_shape())
        if got != list(shape):
            die(f"tensor {name} has shape {got}; expected {list(shape)}")
        t = h.get_tensor(name)
        if t.dtype != dtype:
            # the spec's dtypes are bf16 weights, fp32 router; convert others, loudly
            print(f"torch_layer: note: {name} is {t.dtype}, converted to {dtype}", file=sys.stderr)
            t = t.to(dtype)
        return t

    def close(self):
        self.handles.clear()


class Weights:
    pass


def load_layer(cfg, model_dir, L, dev):
    if not 0 <= L < cfg.layers:
        die(f"--layer {L} is outside [0, {cfg.layers})")
    ck = Checkpoint(model_dir, L)
    H, D, Hq, KVH = cfg.H, cfg.D, cfg.Hq, cfg.KVH
    W = Weights()
    W.layer, W.sparse, W.moe = L, cfg.sparse[L], cfg.moe[L]
    p = f"layers.{L}."

    def lin(suffix, n, k):
        return ck.get(suffix, (n, k), BF16)

    def norm1p(suffix, n):
        # Gemma norm multiplies by (1 + w) in fp32: precompute it once
        return (ck.get(suffix, (n,), BF16).float() + 1.0).to(dev)

    W.in_norm = norm1p(p + "input_layernorm.weight", H)
    W.post_norm = norm1p(p + "post_attention_layernorm.weight", H)
    W.q_norm = norm1p(p + "self_attn.q_norm.weight", D)
    W.k_norm = norm1p(p + "self_attn.k_norm.weight", D)
    parts = [lin(p + "self_attn.q_proj.weight", Hq * D, H),
             lin(p + "self_attn.k_proj.weight", KVH * D, H),
             lin(p + "self_attn.v_proj.weight", KVH * D, H)]
    if W.sparse:
        ix = "index_" if ck.has(p + "self_attn.index_q_proj.weight") else "indexer."
        qn, kn = ("index_q_norm", "index_k_norm") if ix == "index_" else ("indexer.q_norm",
                                                                          "indexer.k_norm")
        parts += [lin(p + f"self_attn.{ix}q_proj.weight", cfg.NI * cfg.Di, H),
                  lin(p + f"self_attn.{ix}k_proj.weight", cfg.Di, H)]
        W.iq_norm = norm1p(p + f"self_attn.{qn}.weight", cfg.Di)
        W.ik_norm = norm1p(p + f"self_attn.{kn}.weight", cfg.Di)
    # one fused projection GEMM (as vLLM's QKVParallelLinear): same bytes, fewer launches
    W.split = [t.shape[0] for t in parts]
    # Its output viewed as [T, heads, D] (q | k | v | iq | ik) is normed and
    # rotated in one pass; this is each head's (1 + w) (v's row is unused:
    # V is taken before the norm).
    rows = [W.q_norm.expand(Hq, D), W.k_norm.expand(KVH, D), torch.ones(KVH, D, device=dev)]
    if W.sparse:
        rows += [W.iq_norm.expand(cfg.NI, D), W.ik_norm.view(1, D)]
    W.head_w = torch.cat(rows, 0).contiguous()
    W.nh = W.head_w.shape[0]
    W.qkv = torch.cat(parts, 0).to(dev)
    del parts
    W.o = lin(p + "self_attn.o_proj.weight", H, Hq * D).to(dev)

    def gate_up(gate, up, fused, n):
        if ck.has(fused + ".weight"):
            return ck.get(fused + ".weight", (2 * n, H), BF16).to(dev)
        return torch.cat([lin(gate + ".weight", n, H), lin(up + ".weight", n, H)], 0).to(dev)

    if W.moe:
        E, I = cfg.E, cfg.I
        moe = p + ("block_sparse_moe" if ck.has(p + "block_sparse_moe.gate.weight") else "mlp")
        W.router = ck.get(moe + ".gate.weight", (E, H), F32).to(dev)
        if cfg.use_bias:
            b = moe + ".e_score_correction_bias"
            if not ck.has(b):
                b = moe + ".gate.e_score_correction_bias"
            W.bias = ck.get(b, (E,), F32).to(dev)
        else:
            W.bias = torch.zeros(E, dtype=F32, device=dev)
        # Stacked expert weights, built once at load: the eager loop uses
        # W.w13[e] views, the graph formulations index_select / group them.
        W.w13 = torch.empty(E, 2 * I, H, dtype=BF16, device=dev)
        W.w2 = torch.empty(E, H, I, dtype=BF16, device=dev)
        if ck.has(moe + ".experts.0.w1.weight"):
            for e in range(E):
                x = f"{moe}.experts.{e}."
                W.w13[e, :I].copy_(lin(x + "w1.weight", I, H))
                W.w13[e, I:].copy_(lin(x + "w3.weight", I, H))
                W.w2[e].copy_(lin(x + "w2.weight", H, I))
        else:
            x = moe + ".experts."
            gu = x + ("gate_up_proj" if ck.has(x + "gate_up_proj") else "gate_up_proj.weight")
            dn = x + ("down_proj" if ck.has(x + "down_proj") else "down_proj.weight")
            W.w13.copy_(ck.get(gu, (E, 2 * I, H), BF16))
            W.w2.copy_(ck.get(dn, (E, H, I), BF16))
        if cfg.Is:
            sx = moe + ".shared_experts."
            W.sh_gu = gate_up(sx + "gate_proj", sx + "up_proj", sx + "gate_up_proj", cfg.Is)
            W.sh_down = lin(sx + "down_proj.weight", H, cfg.Is).to(dev)
    else:
        mx = p + "mlp."
        W.mlp_gu = gate_up(mx + "gate_proj", mx + "up_proj", mx + "gate_up_proj", cfg.dense_dim)
        W.mlp_down = lin(mx + "down_proj.weight", H, cfg.dense_dim).to(dev)
    ck.close()
    return W


def weight_bytes(cfg, W):
    """SPEC §9 weight bytes, except the routed experts (counted per step)."""
    nb = lambda t: t.numel() * 2  # every matrix is bf16; norms too as stored
    attn = nb(W.qkv) + nb(W.o) + 2 * cfg.H * 2 + 2 * cfg.D * 2 + (2 * cfg.Di * 2 if W.sparse else 0)
    out = {"attn": attn, "router": 0, "shared": 0, "mlp": 0, "expert": 0}
    if W.moe:
        out["router"] = cfg.E * cfg.H * 4 + cfg.E * 4
        out["shared"] = (nb(W.sh_gu) + nb(W.sh_down)) if cfg.Is else 0
        out["expert"] = 3 * cfg.I * cfg.H * 2
    else:
        out["mlp"] = nb(W.mlp_gu) + nb(W.mlp_down)
    return out


# ----------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------

class Plan:
    """Everything about a (rows, positions) shape that is fixed before the
    step runs: constant index tensors (made here, not inside a graph capture)
    and which masks the step needs. Masks are skipped only where the shape
    proves them all-true (every row sees whole blocks / the whole cache), so
    SDPA can take its flash path in the benchmark's configuration."""

    def __init__(self, cfg, W, positions, dev, bmm_f32):
        self.cfg, self.dev, self.bmm_f32 = cfg, dev, bmm_f32
        self.T = T = len(positions)
        self.pos_list = list(positions)
        kv = [p + 1 for p in positions]
        self.kv_list = kv
        self.nblk = -(-max(kv) // cfg.block)        # blocks in each sequence's cache
        self.C = self.nblk * cfg.block              # cache capacity (whole blocks)
        self.positions = torch.tensor(positions, dtype=torch.int64, device=dev)
        self.kv_len = self.positions + 1
        self.nblocks_row = (self.kv_len + cfg.block - 1) // cfg.block
        self.ar_T = torch.arange(T, device=dev)
        self.ar_KVH = torch.arange(cfg.KVH, device=dev)
        self.ar_blk = torch.arange(self.nblk, device=dev)
        self.ar_C = torch.arange(self.C, device=dev)
        self.ar_B = torch.arange(cfg.block, device=dev)
        half = cfg.R // 2
        # inv_freq and the angle in float64 (SPEC §2.3: fp32 angles are off by
        # hundredths of a radian near 2^20); only cos/sin are rounded to fp32
        self.inv_freq = (cfg.theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / cfg.R)).to(dev)
        self.sparse = W.sparse
        if W.sparse:
            self.kk = min(cfg.topk, self.nblk)
            self.mask_scores = any(k % cfg.block for k in kv)
            nbr = [-(-k // cfg.block) for k in kv]
            self.mask_attn = self.mask_scores or any(n < self.kk for n in nbr)
            # index_dim^-0.5 * log2 e formed in double, applied as one fp32 multiply
            self.index_scale = float(torch.tensor(cfg.Di ** -0.5 * LOG2E, dtype=F32))
        else:
            self.mask_attn = any(k != self.C for k in kv)

    def new_set(self, gen, with_index):
        cfg, T, C = self.cfg, self.T, self.C
        r = lambda *shape: torch.randn(*shape, generator=gen, device=self.dev, dtype=F32).to(BF16)
        s = {"hidden": r(T, cfg.H), "residual": r(T, cfg.H),
             "kc": torch.empty(T, cfg.KVH, C, cfg.D, dtype=BF16, device=self.dev),
             "vc": torch.empty(T, cfg.KVH, C, cfg.D, dtype=BF16, device=self.dev)}
        # fill in slices so the fp32 temporary stays small for 100+ GB caches
        for name in ("kc", "vc"):
            for t in range(T):
                s[name][t].copy_(r(cfg.KVH, C, cfg.D))
        if with_index:
            s["ikc"] = torch.empty(T, C, cfg.Di, dtype=BF16, device=self.dev)
            for t in range(T):
                s["ikc"][t].copy_(r(C, cfg.Di))
        return s


def set_bytes(s):
    return sum(v.numel() * v.element_size() for v in s.values())


def gemma_norm(x, w1p, eps):
    """Gemma RMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * (1 + w); fp32 out.
    F.rms_norm (torch >= 2.4) is the same formula in fewer kernels; w1p may
    broadcast over more than the last dim (the per-head table), so it is
    applied outside."""
    x = x.float()
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), eps=eps) * w1p
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w1p


def rope(x, cos, sin, R):
    """NeoX RoPE on the first R dims of x [..., d] (fp32): pairs (i, i + R/2)."""
    half = R // 2
    x1, x2, rest = x[..., :half], x[..., half:R], x[..., R:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def swiglu_oai(gate, up, alpha, limit):
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(-limit, limit)
    return (g * torch.sigmoid(alpha * g) * (u + 1.0)).to(BF16)


def sortable(x):
    """fp32 -> int64 keys that order like the floats (the int32 bit trick):
    lets topk break ties by a secondary key exactly, as SPEC §3 and §2.3 say."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def routed_loop(cfg, W, x, ids, w):
    """Eager MoE: tokens sorted by expert, one host sync to learn the counts,
    then a GEMM pair per expert that was chosen (only those weights are read)."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg.E).tolist()  # the host sync
    tok = order // K
    xs = x.index_select(0, tok)
    out = torch.empty(T * K, cfg.H, dtype=BF16, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = F.linear(xs[start:start + n], W.w13[e])
        a = swiglu_oai(h[:, :cfg.I], h[:, cfg.I:], cfg.alpha, cfg.limit)
        out[start:start + n] = F.linear(a, W.w2[e])
        start += n
    y = torch.zeros(T, cfg.H, dtype=F32, device=x.device)
    return y.index_add_(0, tok, out.float() * w.reshape(-1)[order].unsqueeze(1))


def routed_gather(cfg, W, x, ids, w):
    """Graph-safe MoE: gather the chosen experts' stacked weights by id
    (index_select reads only those experts) and run batched GEMVs."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    xk = x.unsqueeze(1).expand(T, K, cfg.H).reshape(T * K, cfg.H, 1)
    h = torch.bmm(W.w13.index_select(0, flat), xk).squeeze(-1)            # [T*K, 2I]
    a = swiglu_oai(h[:, :cfg.I], h[:, cfg.I:], cfg.alpha, cfg.limit)
    d = torch.bmm(W.w2.index_select(0, flat), a.unsqueeze(-1)).squeeze(-1)  # [T*K, H]
    return (d.float().view(T, K, cfg.H) * w.unsqueeze(-1)).sum(1)


def routed_grouped(cfg, W, x, ids, w):
    """Graph-safe MoE on torch._grouped_mm (a private API): tokens sorted by
    expert, group offsets from a scatter-add count (no host sync); experts
    with no tokens are empty groups whose weights are not read."""
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(cfg.E, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // K
    xs = x.index_select(0, tok)
    h = torch._grouped_mm(xs, W.w13.transpose(1, 2), offs=offs)
    a = swiglu_oai(h[:, :cfg.I], h[:, cfg.I:], cfg.alpha, cfg.limit)
    d = torch._grouped_mm(a, W.w2.transpose(1, 2), offs=offs)
    y = torch.zeros(T, cfg.H, dtype=F32, device=x.device)
    return y.index_add_(0, tok, d.float() * w.reshape(-1)[order].unsqueeze(1))


ROUTED = {"loop": routed_loop, "gather": routed_gather, "grouped": routed_grouped}


# Decode attention backends: flash (no mask), memory-efficient (with a mask),
# math last. cuDNN is left out: on an H200 with torch 2.11 it is the default
# and took ~1.5 ms for one row over 128K keys where flash took ~0.1 ms (and
# ~27 us for a sparse layer's 2K selected keys).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q, k, v, mask):
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def layer_step(cfg, W, P, S, moe_how):
    """One decode step of the layer for P.T rows (SPEC §2.3). S holds the
    input set: hidden, residual [T, H], caches kc/vc [T, KVH, C, D] and on
    sparse layers ikc [T, C, Di]. Returns (hidden_out, residual_out, ids)."""
    T, D, Hq, KVH = P.T, cfg.D, cfg.Hq, cfg.KVH
    G = Hq // KVH

    # 1. add + norm (bf16 add rounds once: the residual is a rounding point)
    residual = S["hidden"] + S["residual"]
    x = gemma_norm(residual, W.in_norm, cfg.eps).to(BF16)

    # 2. projections, one GEMM; outputs bf16; heads q | k | v (| iq | ik)
    heads = F.linear(x, W.qkv).view(T, W.nh, D)
    v = heads[:, Hq + KVH:Hq + 2 * KVH]

    # 3. per-head norm + RoPE of every head at once, rounded once
    ang = P.positions.double().unsqueeze(1) * P.inv_freq.unsqueeze(0)
    cos = ang.cos().float().unsqueeze(1)    # [T, 1, R/2]
    sin = ang.sin().float().unsqueeze(1)
    hn = rope(gemma_norm(heads, W.head_w, cfg.eps), cos, sin, cfg.R).to(BF16)
    q = hn[:, :Hq]
    k = hn[:, Hq:Hq + KVH]

    # 4. cache write at each row's position, before attention
    kc, vc = S["kc"], S["vc"]
    ti, gi = P.ar_T.unsqueeze(1), P.ar_KVH.unsqueeze(0)
    kc[ti, gi, P.positions.unsqueeze(1)] = k
    vc[ti, gi, P.positions.unsqueeze(1)] = v

    qg = q.reshape(T, KVH, G, D)  # a KV group's G query heads act as SDPA's query rows
    if W.sparse:
        iq = hn[:, Hq + 2 * KVH:Hq + 2 * KVH + cfg.NI]                   # [T, NI, Di]
        ikc = S["ikc"]
        ikc[P.ar_T, P.positions] = hn[:, W.nh - 1]

        # index scores: fp32 dot over bf16 inputs, one multiply, max per block
        sc = P.bmm_f32(iq, ikc.transpose(1, 2)) * P.index_scale          # [T, NI, C]
        if P.mask_scores:
            vis = P.ar_C.unsqueeze(0) < P.kv_len.unsqueeze(1)
            sc = torch.where(vis.unsqueeze(1), sc, float("-inf"))
        bs = sc.view(T, cfg.NI, P.nblk, cfg.block).amax(-1)             # [T, NI, nblk]
        bs = torch.where(torch.isnan(bs), -torch.finfo(F32).max, bs)    # NaN ranks lowest
        nbr = P.nblocks_row.view(T, 1, 1)
        blk = P.ar_blk.view(1, 1, -1)
        forced = ((blk < cfg.init_blocks) | (blk >= nbr - cfg.local_blocks)) & (blk < nbr)
        bs = torch.where(forced, float("inf"), torch.where(blk < nbr, bs, float("-inf")))
        # ties: the higher block id wins -> block id as the low key bits
        key = sortable(bs) * (1 << 32) + blk
        sel = torch.topk(key, P.kk, dim=-1).indices                     # [T, NI, kk]

        # gather the selected blocks' K and V: [T, KVH, kk*128, D]
        shp = (T, KVH, P.nblk, cfg.block, D)
        bi = (P.ar_T.view(T, 1, 1), P.ar_KVH.view(1, KVH, 1), sel)
        ksel = kc.view(shp)[bi].view(T, KVH, P.kk * cfg.block, D)
        vsel = vc.view(shp)[bi].view(T, KVH, P.kk * cfg.block, D)
        mask = None
        if P.mask_attn:
            kpos = (sel.unsqueeze(-1) * cfg.block + P.ar_B).view(T, KVH, -1)
            mask = (kpos < P.kv_len.view(T, 1, 1)) & (sel < nbr).repeat_interleave(cfg.block, -1)
            mask = mask.unsqueeze(2)                                     # [T, KVH, 1, S]
        attn = sdpa(qg, ksel, vsel, mask)
    else:
        mask = None
        if P.mask_attn:
            mask = (P.ar_C.unsqueeze(0) < P.kv_len.unsqueeze(1)).view(T, 1, 1, P.C)
        attn = sdpa(qg, kc, vc, mask)

    # 6. o_proj, residual add, post norm
    o = F.linear(attn.reshape(T, Hq * D), W.o)
    residual = residual + o
    x = gemma_norm(residual, W.post_norm, cfg.eps).to(BF16)

    # 7. FFN
    ids = None
    if W.moe:
        s = torch.sigmoid(F.linear(x.float(), W.router))                 # fp32 router
        # choose by s + bias; ties: the lower expert id wins -> (E-1-id) low bits
        key = sortable(s + W.bias) * (1 << 32) + (cfg.E - 1 - torch.arange(cfg.E, device=x.device))
        ids = torch.topk(key, cfg.K, dim=-1).indices
        w = s.gather(1, ids)
        w = w / w.sum(-1, keepdim=True)
        y = cfg.rsf * ROUTED[moe_how](cfg, W, x, ids, w)
        if cfg.Is:
            gu = F.linear(x, W.sh_gu)
            y = y + F.linear(swiglu_oai(gu[:, :cfg.Is], gu[:, cfg.Is:], cfg.alpha, cfg.limit),
                             W.sh_down).float()
        out = y.to(BF16)
    else:
        gu = F.linear(x, W.mlp_gu)
        n = cfg.dense_dim
        out = F.linear(swiglu_oai(gu[:, :n], gu[:, n:], cfg.alpha, cfg.limit), W.mlp_down)
    return out, residual, ids


# ----------------------------------------------------------------------------
# Independent reference (slow, per row; --check only)
# ----------------------------------------------------------------------------

def reference_step(cfg, W, P, S):
    """SPEC §2.3 / §3 written row by row in fp32 with explicit bf16 rounding
    points and Python selection, sharing no code with layer_step beyond the
    loaded weights. S is consumed (its caches are written)."""
    r = lambda t: t.to(BF16).float()
    H, D, Hq, KVH, B = cfg.H, cfg.D, cfg.Hq, cfg.KVH, cfg.block
    G = Hq // KVH
    half = cfg.R // 2

    def norm(x, w1p):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.eps) * w1p

    def rot(x, pos):  # x [heads, d] fp32
        inv = [cfg.theta ** (-2.0 * i / cfg.R) for i in range(half)]
        c = torch.tensor([math.cos(pos * f) for f in inv], dtype=F32, device=x.device)
        s = torch.tensor([math.sin(pos * f) for f in inv], dtype=F32, device=x.device)
        y = x.clone()
        y[:, :half] = x[:, :half] * c - x[:, half:cfg.R] * s
        y[:, half:cfg.R] = x[:, half:cfg.R] * c + x[:, :half] * s
        return y

    def ffn(x, wgu, wd, n):
        g = r(x @ wgu[:n].float().T)
        u = r(x @ wgu[n:].float().T)
        g = g.clamp(max=cfg.limit)
        u = u.clamp(-cfg.limit, cfg.limit)
        a = r(g * torch.sigmoid(cfg.alpha * g) * (u + 1))
        return r(a @ wd.float().T)

    wqkv = W.qkv.float()
    offs = [0]
    for n in W.split:
        offs.append(offs[-1] + n)
    outs, ress = [], []
    for t in range(P.T):
        pos = P.pos_list[t]
        kvl = pos + 1
        res = r(S["hidden"][t].float() + S["residual"][t].float())
        x = r(norm(res, W.in_norm))
        pr = r(x @ wqkv.T)
        q = r(rot(norm(pr[offs[0]:offs[1]].view(Hq, D), W.q_norm), pos))
        k = r(rot(norm(pr[offs[1]:offs[2]].view(KVH, D), W.k_norm), pos))
        v = pr[offs[2]:offs[3]].view(KVH, D)
        S["kc"][t, :, pos] = k.to(BF16)
        S["vc"][t, :, pos] = v.to(BF16)
        if W.sparse:
            iq = r(rot(norm(pr[offs[3]:offs[4]].view(cfg.NI, cfg.Di), W.iq_norm), pos))
            ik = r(rot(norm(pr[offs[4]:offs[5]].view(1, cfg.Di), W.ik_norm), pos))
            S["ikc"][t, pos] = ik[0].to(BF16)
        attn = torch.zeros(Hq, D, device=x.device)
        for g in range(KVH):
            if W.sparse:
                scale = float(torch.tensor(cfg.Di ** -0.5 * LOG2E, dtype=F32))
                dots = (S["ikc"][t, :kvl].float() @ iq[g]) * scale
                nb = -(-kvl // B)
                bsc = [dots[b * B:min(kvl, (b + 1) * B)].max().item() for b in range(nb)]
                forced = {b for b in range(nb) if b < cfg.init_blocks or b >= nb - cfg.local_blocks}
                rank = lambda b: (-1e300 if math.isnan(bsc[b]) else bsc[b], b)
                rest = sorted((b for b in range(nb) if b not in forced), key=rank, reverse=True)
                chosen = sorted(forced) + rest[:max(0, cfg.topk - len(forced))]
                keys = [p for b in sorted(chosen) for p in range(b * B, min(kvl, (b + 1) * B))]
                keys = torch.tensor(keys, device=x.device)
            else:
                keys = torch.arange(kvl, device=x.device)
            K = S["kc"][t, g, keys].float()
            V = S["vc"][t, g, keys].float()
            for j in range(G):
                h = g * G + j
                p = torch.softmax((K @ q[h]) * D ** -0.5, -1)
                attn[h] = r(p @ V)
        o = r(attn.reshape(-1) @ W.o.float().T)
        res2 = r(res + o)
        x2 = r(norm(res2, W.post_norm))
        if W.moe:
            sg = torch.sigmoid(x2 @ W.router.T)
            ch = (sg + W.bias).tolist()
            chosen = sorted(range(cfg.E), key=lambda e: (-ch[e], e))[:cfg.K]
            ws = sg[chosen] / sg[chosen].sum()
            y = torch.zeros(H, device=x.device)
            for i, e in enumerate(chosen):
                y = y + ws[i] * ffn(x2, W.w13[e], W.w2[e], cfg.I)
            y = cfg.rsf * y
            if cfg.Is:
                y = y + ffn(x2, W.sh_gu, W.sh_down, cfg.Is)
            out = r(y)
        else:
            out = ffn(x2, W.mlp_gu, W.mlp_down, cfg.dense_dim)
        outs.append(out)
        ress.append(res2)
    return torch.stack(outs), torch.stack(ress)


# ----------------------------------------------------------------------------
# Running and timing
# ----------------------------------------------------------------------------

def make_bmm_f32(dev):
    """The index scores want an fp32 result of a bf16 product (no bf16 rounding
    of the scores). torch.bmm(out_dtype=fp32) does that on CUDA; elsewhere (or
    where it is missing) widen the inputs."""
    if dev.type == "cuda":
        try:
            a = torch.ones(1, 2, 8, dtype=BF16, device=dev)
            torch.bmm(a, a.transpose(1, 2), out_dtype=F32)
            return lambda x, y: torch.bmm(x, y, out_dtype=F32)
        except (TypeError, RuntimeError, NotImplementedError):
            print("torch_layer: note: torch.bmm(out_dtype=float32) unavailable; index scores "
                  "widen their inputs to fp32", file=sys.stderr)
    return lambda x, y: torch.bmm(x.float(), y.float())


class Runner:
    """A step bound to one input set: eager calls or a captured graph."""

    def __init__(self, cfg, W, P, sets, mode, moe_how, dev):
        self.cfg, self.W, self.P, self.sets, self.mode, self.how = cfg, W, P, sets, mode, moe_how
        self.graphs, self.outs = [], []
        if mode == "graph":
            # warm up outside capture (cuBLAS handles, allocator, lazy init),
            # on a side stream as the CUDA-graph docs ask
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):
                    layer_step(cfg, W, P, sets[0], moe_how)
            torch.cuda.current_stream(dev).wait_stream(side)
            torch.cuda.synchronize(dev)
            # one graph per input set (each bound to its own static buffers),
            # sharing one memory pool: replays are sequential on one stream,
            # and every graph's outputs stay referenced in self.outs
            pool = torch.cuda.graph_pool_handle()
            for s in sets:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = layer_step(cfg, W, P, s, moe_how)
                self.graphs.append(g)
                self.outs.append(out)
            torch.cuda.synchronize(dev)

    def __call__(self, i):
        if self.mode == "graph":
            self.graphs[i].replay()
            return self.outs[i]
        return layer_step(self.cfg, self.W, self.P, self.sets[i], self.how)


def time_runner(run, n_sets, iters, warmup, dev):
    for i in range(max(warmup, n_sets)):
        run(i % n_sets)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
        for i in range(iters):
            ev[i][0].record()
            run(i % n_sets)
            ev[i][1].record()
        torch.cuda.synchronize(dev)
        times = [a.elapsed_time(b) * 1e3 for a, b in ev]
    else:
        times = []
        for i in range(iters):
            t0 = time.perf_counter()
            run(i % n_sets)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def stream_read_gbps(dev):
    """Streaming read bandwidth as PyTorch sees it (an fp32-accumulated sum
    over 4 GiB of bf16), for the 'of stream' column."""
    if dev.type != "cuda":
        return None
    x = torch.ones(2 << 30, dtype=BF16, device=dev)
    for _ in range(3):
        x.sum(dtype=F32)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum(dtype=F32)
        b.record()
        torch.cuda.synchronize(dev)
        ts.append(a.elapsed_time(b) / 1e3)
    n = x.numel() * 2
    del x
    torch.cuda.empty_cache()
    return n / statistics.median(ts) / 1e9


FORMULATION = {
    "loop": "moe: loop over chosen experts (argsort + one host sync, GEMM pair per expert)",
    "gather": "moe: index_select of chosen experts' stacked weights + bmm (per row x slot)",
    "grouped": "moe: torch._grouped_mm over tokens sorted by expert (empty groups skipped)",
}


def formulation(W, P, how):
    if W.sparse:
        attn = "attn: bf16 bmm index scores (fp32 out), block max, int64-key topk, gather " \
               "selected K/V blocks, SDPA " + ("mem-efficient with mask" if P.mask_attn else "flash")
    else:
        attn = "attn: SDPA " + ("mem-efficient with mask" if P.mask_attn else "flash") + \
               " over the whole contiguous cache"
    ffn = FORMULATION[how] if W.moe else "mlp: fused gate_up GEMM + down GEMM"
    return f"{attn}; {ffn}; cache contiguous per sequence (not paged)"


def step_bytes(cfg, W, P, wb, unique_experts):
    """SPEC §9 bytes a step must read, for P's rows."""
    n = wb["attn"] + wb["router"] + wb["shared"] + wb["mlp"] + wb["expert"] * unique_experts
    if W.sparse:
        n += sum(-(-k // cfg.block) * cfg.block for k in P.kv_list) * cfg.Di * 2  # index cache
        n += P.T * cfg.KVH * P.kk * cfg.block * cfg.D * 2 * 2                      # K+V selected
    else:
        n += sum(P.kv_list) * cfg.KVH * cfg.D * 2 * 2                              # K+V all
    return n


def rel_l2(a, b):
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


def clone_set(s):
    return {k: v.clone() for k, v in s.items()}


def run_check(cfg, W, dev, graph_how, seed):
    """Eager vs graph (or the graph formulation run eagerly on a CPU) vs the
    reference, on two small shapes: ragged positions with a partial last
    block (the masked paths) and the benchmark's shape (every row at
    context-1, whole blocks: the unmasked paths)."""
    bmm_f32 = make_bmm_f32(dev)
    topk_tokens = cfg.topk * cfg.block if W.sparse else 512
    c = topk_tokens + 5 * cfg.block          # enough blocks that selection chooses
    cases = [("ragged", [c + 37 - 1, c - 300, c - 1 - 4 * cfg.block]),
             ("uniform", [c - 1, c - 1])]
    ok = True
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, positions in cases:
        P = Plan(cfg, W, positions, dev, bmm_f32)
        base = P.new_set(gen, W.sparse)
        eager = layer_step(cfg, W, P, clone_set(base), "loop")
        if dev.type == "cuda":
            gs = clone_set(base)
            run = Runner(cfg, W, P, [gs], "graph", graph_how, dev)
            other = tuple(t.clone() if t is not None else None for t in run(0))
            other_name = f"graph ({graph_how})"
            del run
        else:
            other = layer_step(cfg, W, P, clone_set(base), graph_how)
            other_name = f"{graph_how} formulation (eager: no CUDA graphs on {dev.type})"
        ref = reference_step(cfg, W, P, clone_set(base))
        if W.moe and not torch.equal(eager[2], other[2]):
            print(f"  {name}: expert choice differs between eager and {other_name}")
            ok = False
        for label, got, want in [(f"eager vs {other_name}", other, eager),
                                 ("eager vs reference", eager, ref),
                                 (f"{other_name} vs reference", other, ref)]:
            eh = rel_l2(got[0], want[0])
            er = rel_l2(got[1], want[1])
            good = eh <= TOL and er <= TOL
            ok &= good
            print(f"  {name:8s} rows={P.T} positions={positions}: {label}: rel L2 hidden "
                  f"{eh:.2e}, residual {er:.2e} {'ok' if good else 'FAIL'}")
        del base
    return ok


def parse_list(s, what):
    try:
        v = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        die(f"{what}: '{s}' is not a comma-separated list of integers")
    if not v or min(v) < 1:
        die(f"{what}: values must be positive integers")
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    ap.add_argument("--layer", type=int, required=True, help="layer index to benchmark")
    ap.add_argument("--rows", default="1,2,4,8,16", help="rows (sequences) per step, a list")
    ap.add_argument("--context", default="4096,32768,131072",
                    help="tokens per sequence incl. the new one (it sits at context-1), a list")
    ap.add_argument("--modes", default="eager,graph", help="eager, graph or both")
    ap.add_argument("--iters", type=int, default=50, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (at least one per set)")
    ap.add_argument("--sets", type=int, default=0,
                    help="input sets cycled (0: enough to exceed the L2 cache, at least 4)")
    ap.add_argument("--graph-moe", default="auto", choices=["auto", "gather", "grouped"],
                    help="MoE formulation inside graphs: grouped (torch._grouped_mm), gather "
                         "(index_select + bmm); auto: grouped where torch has it on CUDA")
    ap.add_argument("--json", help="write the records here (a JSON list)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true",
                    help="compare eager, graph and a reference at a small size, then exit")
    a = ap.parse_args()

    dev = torch.device(a.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            die("CUDA is not available; use --device cpu")
        if dev.index is not None:
            torch.cuda.set_device(dev.index)
        dev = torch.device("cuda", torch.cuda.current_device())
    # the router is fp32 math (SPEC §2.3): no TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(False)

    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("eager", "graph"):
            die(f"--modes: unknown mode '{m}' (eager, graph)")
    if a.iters < 1:
        die("--iters must be >= 1")
    rows_list = parse_list(a.rows, "--rows")
    ctx_list = parse_list(a.context, "--context")

    cfg = Config(a.model)
    t0 = time.time()
    W = load_layer(cfg, a.model, a.layer, dev)
    if a.graph_moe == "auto":
        a.graph_moe = "grouped" if dev.type == "cuda" and hasattr(torch, "_grouped_mm") else "gather"
    if a.graph_moe == "grouped" and not hasattr(torch, "_grouped_mm"):
        die("--graph-moe grouped needs torch._grouped_mm, which this torch lacks")
    kind = ("sparse" if W.sparse else "dense") + " attention, " + ("MoE" if W.moe else "dense MLP")
    print(f"layer {a.layer} ({kind}) of {a.model}: hidden {cfg.H}, {cfg.Hq} q / {cfg.KVH} kv heads"
          + (f", {cfg.NI} index heads, top-{cfg.topk} blocks" if W.sparse else "")
          + (f", {cfg.E} experts x {cfg.I} top-{cfg.K}, shared {cfg.Is}" if W.moe else
             f", MLP {cfg.dense_dim}")
          + f"; loaded in {time.time() - t0:.1f} s on {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f", torch {torch.__version__}")

    if a.check:
        ok = run_check(cfg, W, dev, a.graph_moe, a.seed)
        print("check:", "PASS" if ok else "FAIL")
        sys.exit(0 if ok else 1)

    if "graph" in modes and dev.type != "cuda":
        print("note: graph mode needs CUDA; skipped on", dev.type)
        modes = [m for m in modes if m != "graph"]

    bmm_f32 = make_bmm_f32(dev)
    wb = weight_bytes(cfg, W)
    bw = stream_read_gbps(dev)
    print("caches: contiguous per sequence, not paged: K/V [rows, kv_heads, context, head_dim], "
          "index keys [rows, context, index_dim], bf16 random O(1); each row decodes one token "
          "at position context-1")
    if bw:
        print(f"streaming read (torch sum over 4 GiB): {bw:.0f} GB/s")
    hdr = f"{'rows':>4} {'context':>7} {'mode':>5} {'median us':>10} {'MB read':>9} " \
          f"{'GB/s':>7} {'of stream':>9} {'experts':>7} {'sets':>4}"
    print(hdr)
    print("-" * len(hdr))
    records = []
    forms = {}
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)
    for C in ctx_list:
        for T in rows_list:
            P = Plan(cfg, W, [C - 1] * T, dev, bmm_f32)
            sets = []
            try:
                sets.append(P.new_set(gen, W.sparse))
                sb = set_bytes(sets[0])
                n_sets = a.sets or max(4, -(-2 * L2_BYTES // sb))
                if not a.sets and dev.type == "cuda":
                    free, _ = torch.cuda.mem_get_info(dev)
                    fit = int(0.6 * free // sb) + 1  # leave room for graph pools / gathers
                    n_sets = max(1, min(n_sets, fit))
                n_sets = min(n_sets, 64)
                while len(sets) < n_sets:
                    sets.append(P.new_set(gen, W.sparse))
            except torch.cuda.OutOfMemoryError:
                print(f"{T:>4} {C:>7}  skipped: out of memory building the caches")
                sets = None
                torch.cuda.empty_cache()
                continue
            if n_sets < 4 and not a.sets:
                print(f"note: only {n_sets} input set(s) fit in memory at rows {T} context {C}")
            # unique experts per set: one untimed eager step each (also a warm-up)
            uniq = []
            for s in sets:
                _, _, ids = layer_step(cfg, W, P, s, "loop")
                uniq.append(int(torch.unique(ids).numel()) if ids is not None else 0)
            n_exp = statistics.mean(uniq)
            nbytes = step_bytes(cfg, W, P, wb, n_exp)
            for mode in modes:
                how = "loop" if mode == "eager" else a.graph_moe
                try:
                    run = Runner(cfg, W, P, sets, mode, how, dev)
                    us = time_runner(run, len(sets), a.iters, a.warmup, dev)
                    del run
                except torch.cuda.OutOfMemoryError:
                    run = None  # drop its graphs and pool before empty_cache
                    print(f"{T:>4} {C:>7} {mode:>5}  skipped: out of memory")
                    torch.cuda.empty_cache()
                    continue
                gbps = nbytes / (us * 1e-6) / 1e9
                form = formulation(W, P, how)
                forms.setdefault(form, mode)
                print(f"{T:>4} {C:>7} {mode:>5} {us:>10.1f} {nbytes / 1e6:>9.1f} {gbps:>7.0f} "
                      + (f"{100 * gbps / bw:>8.0f}%" if bw else f"{'-':>9}")
                      + (f" {n_exp:>7.1f}" if W.moe else f" {'-':>7}") + f" {len(sets):>4}")
                records.append({"layer": a.layer, "rows": T, "context": C, "mode": mode,
                                "median_us": round(us, 2), "bytes": int(round(nbytes)),
                                "formulation": form, "gbps": round(gbps, 1),
                                "unique_experts": n_exp, "sets": len(sets)})
                if a.json:  # rewrite after each record, so a crash keeps the rest
                    with open(a.json, "w") as f:
                        json.dump(records, f, indent=1)
            del sets, P
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    for form, mode in forms.items():
        print(f"{mode}: {form}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {a.json}")


if __name__ == "__main__":
    main()
