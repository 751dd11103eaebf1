#!/usr/bin/env python3
"""Independent numpy reference of the MiniMax-M3 text model forward pass.

This file is the project's "float reference written from the page" (SPEC
section 8): it is derived from shared/SPEC.md sections 2-4 alone, shares no code
and no design with the C engine, and is used to check the engine's logits (and,
through `trace`, its per-layer tensors and sparse selections).  It reads a
checkpoint folder the way the engine does (config.json + one or several
safetensors files, bf16 / fp32 / MXFP8 weights), runs one teacher-forced request
(positions 0..L-1) through every layer at once, and writes the fp32 logits of
the rows that matter as a .npy file.

Precision model (SPEC 2.3 "Rounding points"): every tensor is held in float32;
the tensors the spec names are rounded to bf16 (round-to-nearest-even) exactly
where the spec says they are materialised, and nowhere else.

Reductions follow one convention, "f64 accumulate, round once to fp32", so that
each result is the correctly rounded fp32 value of the (nearly) exact sum and
therefore does not depend on summation order.  Why: a plain fp32 sum depends on
the order of its terms (BLAS blocking, SIMD width, threads), and a last-bit
difference there flips bf16 roundings downstream, which moves the logits by a
few 1e-3 relative.  With the convention, an independent implementation (the C
engine) that sums in any order it likes gets the same fp32 value, so the two
can agree bit for bit (a disagreement needs the float64 sum to fall within
~1e-16 relative of an fp32 rounding boundary, about one result in 10^7-10^8).
Operands are bf16-valued or fp32, so every product of two of them is exact in
float64.  Concretely:
  1. Matrix / dot products (mm for every projection, router logits with the
     fp32 router weight, lm_head logits, q.k attention scores, index dots
     iq.ik, p.v): float64 products of the fp32 operands, summed in float64,
     cast to float32 once.
  2. Gemma RMSNorm: ms = f32(sum_f64(x_i^2) / dim) (sum and division in
     float64, one cast); inv = f32(1) / sqrt(ms + f32(eps)) in fp32;
     y = (x * inv) * (f32(1) + w) in fp32, in exactly that order.
  3. Attention softmax per (row, head): s_j = f32(dot_f64(q, k_j)) * f32(scale)
     (scale = head_dim^-0.5 formed in double, cast once; one fp32 multiply),
     m = max_j s_j, e_j = exp(s_j - m), sum = f32(sum_f64(e_j)),
     p_j = e_j / sum in fp32, out_d = f32(sum_f64(p_j * v_jd)), then the bf16
     rounding of each head output.
  4. Index scores: dot = f32(dot_f64(iq, ik)); score = (max over the block's
     visible positions of dot) * f32(index_dim^-0.5 * log2(e)), the constant
     formed in double and cast once, the multiply in fp32.
  5. Router: logits = f32(dot_f64(x, W)); sigmoid, selection, weights
     s / sum(s) and the MoE combine (acc += w_j * e_j in routing-rank order,
     y = f32(rsf) * acc + shared, rounded once) are fp32.
  6. Everything elementwise is fp32 (RoPE, SwiGLU-OAI, sigmoid, residual adds).
     exp (softmax, sigmoid) is the correctly rounded fp32 exponential, realised
     as f32(exp(double(x))) (exp_f32): numpy's own float32 exp is a SIMD
     approximation up to 2 ulp off that differs from libm expf on ~40% of
     inputs, which would defeat the point of the convention.

Command line:
    python3 m3_ref.py --model DIR --tokens 1,2,3 --prompt-len P --out F.npy [--greedy]
Output row i holds the logits at position P-1+i, i.e. the distribution the
token at index P+i was (or would be) drawn from.  Exit status 2 with a message
naming the problem on a bad checkpoint, config or argument.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

F32 = np.float32
LOG2E = math.log2(math.e)


class RefError(Exception):
    """A problem with the checkpoint, config or arguments (CLI exit status 2)."""


# --------------------------------------------------------------------------
# Number formats
# --------------------------------------------------------------------------

def bf16_round(x):
    """Round float32 values to the nearest bf16 (ties to even), returned as float32.

    Done on the uint32 bit pattern, not through any library bf16 type, so the
    rule is explicit: add 0x7FFF plus the lowest kept bit, then truncate.  That
    carries overflow into the exponent correctly (large finite -> inf, as
    round-to-nearest requires) and keeps inf as inf.  A NaN could turn into inf
    by truncation (payload only in the dropped bits), so NaNs are forced to a
    quiet NaN with their sign: NaN stays NaN.
    """
    a = np.array(x, dtype=F32, copy=True, ndmin=1)
    bits = a.view(np.uint32)
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
    nan_bits = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x00400000)
    out = np.where(np.isnan(a), nan_bits, rounded).astype(np.uint32).view(F32)
    return out.reshape(np.shape(x))


def bf16_bits_to_f32(u16):
    """Widen raw bf16 bit patterns (uint16) to float32 (exact)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(F32)


def _build_e4m3_table():
    # e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at
    # exponent 0, no infinities; only S.1111.111 (0x7F / 0xFF) is NaN.
    table = np.zeros(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        exp = (b >> 3) & 0xF
        man = b & 0x7
        if exp == 0xF and man == 0x7:
            table[b] = np.nan
        elif exp == 0:
            table[b] = sign * (man / 8.0) * 2.0 ** (1 - 7)
        else:
            table[b] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return table


E4M3_TABLE = _build_e4m3_table()


def e4m3_to_float(raw):
    """Decode e4m3fn bytes (uint8 array) to float32 (every value is exact in fp32)."""
    return E4M3_TABLE[np.asarray(raw, dtype=np.uint8)].astype(F32)


def dequant_mxfp8(w_raw, scale_raw):
    """MXFP8 weight [N, K] (e4m3 bytes) with uint8 block exponents [N, K/32] -> float32.

    Each 32-column block is scaled by 2^(s - 127).  s = 255 is NaN in the OCP MX
    E8M0 format (2^128 is not a float32 either), so it decodes to NaN.
    """
    w_raw = np.asarray(w_raw, dtype=np.uint8)
    scale_raw = np.asarray(scale_raw, dtype=np.uint8)
    n, k = w_raw.shape
    if k % 32 or scale_raw.shape != (n, k // 32):
        raise RefError(f"MXFP8 scale shape {scale_raw.shape} does not match weight {w_raw.shape} "
                       f"(want [{n}, {k}/32])")
    scale = np.ldexp(1.0, scale_raw.astype(np.int64) - 127)
    scale[scale_raw == 255] = np.nan
    vals = E4M3_TABLE[w_raw].reshape(n, k // 32, 32) * scale[:, :, None]
    # e4m3 x 2^e is exact in float64; the cast to fp32 only matters for exponents
    # fp32 cannot hold (then it over/underflows like any fp32 arithmetic would).
    return vals.reshape(n, k).astype(F32)


# --------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------

DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
               "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
# The dtypes this reference (and the engine) can compute with.
SUPPORTED_DTYPES = {"BF16", "F32", "F8_E4M3", "U8"}


class SafetensorsFile:
    """One .safetensors file: header parsed eagerly, data memory-mapped lazily.

    Memory-mapping (rather than reading) keeps the reference light: only the
    tensors a forward touches are ever paged in and converted.
    """

    def __init__(self, path):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise RefError(f"{path}: too short for a safetensors file")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > size - 8:
                    raise RefError(f"{path}: header length {hlen} exceeds file size {size}")
                header = json.loads(f.read(hlen).decode("utf-8"))
        except OSError as e:
            raise RefError(f"cannot read {path}: {e}") from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RefError(f"{path}: malformed safetensors header: {e}") from e
        if not isinstance(header, dict):
            raise RefError(f"{path}: safetensors header is not a JSON object")
        self.data_start = 8 + hlen
        self.size = size
        self.entries = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = info["dtype"]
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise RefError(f"{path}: malformed header entry for {name}: {e}") from e
            if not (0 <= begin <= end and self.data_start + end <= size):
                raise RefError(f"{path}: tensor {name} data_offsets [{begin}, {end}] "
                               f"outside the file")
            if dtype in DTYPE_SIZES:
                want = DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
                if want != end - begin:
                    raise RefError(f"{path}: tensor {name} ({dtype} {list(shape)}) needs "
                                   f"{want} bytes, header gives {end - begin}")
            self.entries[name] = (dtype, shape, begin, end)
        self._mm = None

    def raw(self, name):
        """The tensor's bytes as a read-only array of its storage type, no conversion."""
        dtype, shape, begin, end = self.entries[name]
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        storage = {"BF16": np.uint16, "F32": "<f4", "F8_E4M3": np.uint8, "U8": np.uint8}[dtype]
        buf = self._mm[self.data_start + begin:self.data_start + end]
        return np.frombuffer(buf, dtype=storage).reshape(shape)


class Checkpoint:
    """All tensors of a checkpoint folder, single-file or sharded by an index."""

    def __init__(self, model_dir):
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        single_path = os.path.join(model_dir, "model.safetensors")
        self.files = {}
        self.where = {}  # tensor name -> SafetensorsFile
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RefError(f"{index_path}: unreadable or has no weight_map: {e}") from e
            for name, fname in weight_map.items():
                if fname not in self.files:
                    path = os.path.join(model_dir, fname)
                    if not os.path.exists(path):
                        raise RefError(f"shard {fname} named by {index_path} is missing")
                    self.files[fname] = SafetensorsFile(path)
                shard = self.files[fname]
                if name not in shard.entries:
                    raise RefError(f"tensor {name} is listed for shard {fname} but is not in it")
                self.where[name] = shard
        elif os.path.exists(single_path):
            shard = SafetensorsFile(single_path)
            self.files["model.safetensors"] = shard
            for name in shard.entries:
                self.where[name] = shard
        else:
            raise RefError(f"{model_dir}: neither model.safetensors nor "
                           f"model.safetensors.index.json found")

    def __contains__(self, name):
        return name in self.where

    def info(self, name):
        dtype, shape, _, _ = self.where[name].entries[name]
        return dtype, shape

    def raw(self, name):
        dtype, _ = self.info(name)
        if dtype not in SUPPORTED_DTYPES:
            raise RefError(f"tensor {name} has unsupported dtype {dtype}")
        return self.where[name].raw(name)


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

class Config:
    """The text-model settings the forward needs, normalised from config.json."""


def _layer_list(value, n, what):
    if not isinstance(value, list) or len(value) != n:
        raise RefError(f"config: {what} must be a list of {n} entries (one per layer), got {value!r}")
    return value


def parse_config(raw):
    """Read a config.json dict (text config itself or nested under text_config)."""
    tc = raw.get("text_config", raw) if isinstance(raw, dict) else None
    if not isinstance(tc, dict):
        raise RefError("config: not a JSON object")
    sac = tc.get("sparse_attention_config") or {}
    if not isinstance(sac, dict):
        raise RefError("config: sparse_attention_config is not an object")

    def need(key):
        if key not in tc:
            raise RefError(f"config: missing required field {key}")
        return tc[key]

    def sget(key, default):
        # Sparse settings live in sparse_attention_config; flattened exports put
        # them at the top level.
        return sac.get(key, tc.get(key, default))

    c = Config()
    c.hidden = int(need("hidden_size"))
    c.n_layers = int(need("num_hidden_layers"))
    c.n_heads = int(need("num_attention_heads"))
    c.n_kv = int(need("num_key_value_heads"))
    c.head_dim = int(tc.get("head_dim") or c.hidden // c.n_heads)
    c.vocab = int(need("vocab_size"))
    c.eps = float(tc.get("rms_norm_eps", 1e-6))
    rope_theta = tc.get("rope_theta")
    if rope_theta is None and isinstance(tc.get("rope_parameters"), dict):
        rope_theta = tc["rope_parameters"].get("rope_theta")
    if rope_theta is None:
        raise RefError("config: missing required field rope_theta")
    c.rope_theta = float(rope_theta)
    scaling = tc.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise RefError(f"config: rope_scaling {scaling!r} is not supported (plain RoPE only)")
    if tc.get("rotary_dim") is not None:
        c.rotary_dim = int(tc["rotary_dim"])
    elif tc.get("partial_rotary_factor") is not None:
        c.rotary_dim = int(round(float(tc["partial_rotary_factor"]) * c.head_dim))
    else:
        c.rotary_dim = c.head_dim
    if c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        raise RefError(f"config: rotary_dim {c.rotary_dim} must be even and in (0, head_dim={c.head_dim}]")
    if c.n_kv <= 0 or c.n_heads % c.n_kv:
        raise RefError(f"config: num_attention_heads {c.n_heads} is not a multiple of "
                       f"num_key_value_heads {c.n_kv}")
    c.tie = bool(tc.get("tie_word_embeddings", False))

    for key, want in (("hidden_act", "swigluoai"), ("scoring_func", "sigmoid"),
                      ("qk_norm_type", "per_head")):
        if key in tc and tc[key] != want:
            raise RefError(f"config: {key}={tc[key]!r} is not supported (want {want!r})")
    if tc.get("use_gemma_norm", True) is not True:
        raise RefError("config: use_gemma_norm must be true")
    c.swiglu_alpha = float(tc.get("swiglu_alpha", 1.702))
    c.swiglu_limit = float(tc.get("swiglu_limit", 7.0))

    # Per-layer FFN kind.
    if "moe_layer_freq" in tc:
        c.moe = [int(v) == 1 for v in _layer_list(tc["moe_layer_freq"], c.n_layers, "moe_layer_freq")]
    elif "mlp_layer_types" in tc:
        types = _layer_list(tc["mlp_layer_types"], c.n_layers, "mlp_layer_types")
        c.moe = [str(t).lower() in ("sparse", "moe") for t in types]
    else:
        raise RefError("config: missing moe_layer_freq (per-layer list, 1 = MoE, 0 = dense MLP)")
    c.dense_inter = int(tc.get("dense_intermediate_size", tc.get("intermediate_size", 0)))
    c.inter = int(tc.get("intermediate_size", 0))
    c.n_experts = int(tc.get("num_local_experts", 0))
    c.topk_experts = int(tc.get("num_experts_per_tok", 0))
    c.use_bias = bool(tc.get("use_routing_bias", True))
    c.rsf = float(tc.get("routed_scaling_factor", 1.0))
    c.n_shared = int(tc.get("n_shared_experts", 0))
    c.shared_inter = int(tc.get("shared_intermediate_size", c.inter))
    if any(c.moe):
        if not (c.n_experts > 0 and 0 < c.topk_experts <= c.n_experts and c.inter > 0):
            raise RefError(f"config: MoE layers need num_local_experts > 0, 0 < num_experts_per_tok "
                           f"<= experts and intermediate_size > 0 (got {c.n_experts}, "
                           f"{c.topk_experts}, {c.inter})")
        if c.n_shared not in (0, 1):
            raise RefError(f"config: n_shared_experts={c.n_shared} not supported (0 or 1)")
    if not all(c.moe) and c.dense_inter <= 0:
        raise RefError("config: dense MLP layers need dense_intermediate_size (or intermediate_size)")

    # Per-layer attention kind; a config without sparse settings is all dense.
    freq = sget("sparse_attention_freq", None)
    c.sparse = ([False] * c.n_layers if freq is None else
                [int(v) == 1 for v in _layer_list(freq, c.n_layers, "sparse_attention_freq")])
    c.block_size = int(sget("sparse_block_size", 128))
    c.topk_blocks = int(sget("sparse_topk_blocks", 0))
    c.init_blocks = int(sget("sparse_init_block", 0))
    c.local_blocks = int(sget("sparse_local_block", 1))
    c.index_dim = int(sget("sparse_index_dim", c.head_dim))
    c.n_index_heads = int(sget("sparse_num_index_heads", c.n_kv))
    if any(c.sparse):
        if c.block_size <= 0 or c.topk_blocks <= 0:
            raise RefError(f"config: sparse layers need sparse_block_size > 0 and sparse_topk_blocks > 0 "
                           f"(got {c.block_size}, {c.topk_blocks})")
        if c.init_blocks < 0 or c.local_blocks < 0:
            raise RefError("config: sparse_init_block / sparse_local_block must be >= 0")
        if c.n_index_heads != c.n_kv:
            raise RefError(f"config: sparse_num_index_heads {c.n_index_heads} must equal "
                           f"num_key_value_heads {c.n_kv} (each index head selects for its KV group)")
        if c.rotary_dim > c.index_dim:
            raise RefError(f"config: rotary_dim {c.rotary_dim} exceeds sparse_index_dim {c.index_dim}")
        st = sget("sparse_score_type", "max")
        if st != "max":
            raise RefError(f"config: sparse_score_type={st!r} not supported (want 'max')")
        if sget("sparse_disable_index_value", True) is False:
            raise RefError("config: index value/output weights (sparse_disable_index_value=false) "
                           "are not supported")
    return c


# --------------------------------------------------------------------------
# Model: tensor naming, validation, lazy float32 weights
# --------------------------------------------------------------------------

PREFIXES = ("language_model.model.", "model.language_model.", "model.")
LM_HEAD_NAMES = ("language_model.lm_head.weight", "lm_head.weight", "model.language_model.lm_head.weight")
# Newer exports spell the index branch self_attn.indexer.*; both are accepted.
ALIASES = {
    "self_attn.index_q_proj": ("self_attn.index_q_proj", "self_attn.indexer.q_proj"),
    "self_attn.index_k_proj": ("self_attn.index_k_proj", "self_attn.indexer.k_proj"),
    "self_attn.index_q_norm": ("self_attn.index_q_norm", "self_attn.indexer.q_norm"),
    "self_attn.index_k_norm": ("self_attn.index_k_norm", "self_attn.indexer.k_norm"),
}


class Model:
    """A loaded checkpoint: config, tensor-name resolution and float32 weights.

    Weights are converted on first use; with `cache` they are kept (fast for the
    small test models, which are run many times), without it they are dropped
    after use so a large checkpoint streams through memory one tensor at a time.
    """

    def __init__(self, model_dir, cache=None):
        cfg_path = os.path.join(model_dir, "config.json")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise RefError(f"cannot read {cfg_path}: {e}") from e
        self.cfg = parse_config(raw)
        self.ckpt = Checkpoint(model_dir)
        for p in PREFIXES:
            if p + "embed_tokens.weight" in self.ckpt:
                self.prefix = p
                break
        else:
            raise RefError("checkpoint has no embed_tokens.weight under any of the prefixes "
                           + ", ".join(PREFIXES))
        if cache is None:
            total = sum(s.size for s in self.ckpt.files.values())
            cache = total < (1 << 30)
        self.cache = cache
        self._weights = {}
        self.validate()

    # -- names ---------------------------------------------------------------
    def name(self, suffix):
        """Full tensor name for a suffix like 'layers.3.self_attn.q_proj.weight' (or None)."""
        for base, alts in ALIASES.items():
            if base in suffix:
                for alt in alts:
                    full = self.prefix + suffix.replace(base, alt)
                    if full in self.ckpt:
                        return full
                return None
        full = self.prefix + suffix
        return full if full in self.ckpt else None

    def lm_head_name(self):
        if self.cfg.tie:
            return self.prefix + "embed_tokens.weight"
        for n in LM_HEAD_NAMES:
            if n in self.ckpt:
                return n
        return None

    # -- validation ------------------------------------------------------------
    def expected_tensors(self):
        """(suffix, shape, kind) of every tensor the forward reads; kind is
        'plain' (bf16/fp32 weight), 'linear' (may be MXFP8) or 'router' (fp32)."""
        c = self.cfg
        H, hd = c.hidden, c.head_dim
        out = [("embed_tokens.weight", (c.vocab, H), "plain"), ("norm.weight", (H,), "plain")]
        for i in range(c.n_layers):
            L = f"layers.{i}."
            out += [(L + "input_layernorm.weight", (H,), "plain"),
                    (L + "post_attention_layernorm.weight", (H,), "plain"),
                    (L + "self_attn.q_proj.weight", (c.n_heads * hd, H), "linear"),
                    (L + "self_attn.k_proj.weight", (c.n_kv * hd, H), "linear"),
                    (L + "self_attn.v_proj.weight", (c.n_kv * hd, H), "linear"),
                    (L + "self_attn.o_proj.weight", (H, c.n_heads * hd), "linear"),
                    (L + "self_attn.q_norm.weight", (hd,), "plain"),
                    (L + "self_attn.k_norm.weight", (hd,), "plain")]
            if c.sparse[i]:
                out += [(L + "self_attn.index_q_proj.weight", (c.n_index_heads * c.index_dim, H), "linear"),
                        (L + "self_attn.index_k_proj.weight", (c.index_dim, H), "linear"),
                        (L + "self_attn.index_q_norm.weight", (c.index_dim,), "plain"),
                        (L + "self_attn.index_k_norm.weight", (c.index_dim,), "plain")]
            if c.moe[i]:
                M = L + "block_sparse_moe."
                out.append((M + "gate.weight", (c.n_experts, H), "router"))
                if c.use_bias:
                    out.append((M + "e_score_correction_bias", (c.n_experts,), "router"))
                for e in range(c.n_experts):
                    E = f"{M}experts.{e}."
                    out += [(E + "w1.weight", (c.inter, H), "linear"),
                            (E + "w3.weight", (c.inter, H), "linear"),
                            (E + "w2.weight", (H, c.inter), "linear")]
                if c.n_shared:
                    S = M + "shared_experts."
                    out += [(S + "gate_proj.weight", (c.shared_inter, H), "linear"),
                            (S + "up_proj.weight", (c.shared_inter, H), "linear"),
                            (S + "down_proj.weight", (H, c.shared_inter), "linear")]
            else:
                out += [(L + "mlp.gate_proj.weight", (c.dense_inter, H), "linear"),
                        (L + "mlp.up_proj.weight", (c.dense_inter, H), "linear"),
                        (L + "mlp.down_proj.weight", (H, c.dense_inter), "linear")]
        return out

    def validate(self):
        """Check presence, dtype and shape of every tensor from the headers alone,
        so a bad checkpoint fails before any compute, naming all its problems."""
        problems = []
        for suffix, shape, kind in self.expected_tensors():
            full = self.name(suffix)
            if full is None:
                problems.append(f"missing tensor {self.prefix}{suffix}")
                continue
            dtype, got = self.ckpt.info(full)
            problems += self._check(full, dtype, got, shape, kind)
        head = self.lm_head_name()
        if head is None:
            problems.append("missing lm_head weight (tried " + ", ".join(LM_HEAD_NAMES)
                            + "; tie_word_embeddings is false)")
        elif not self.cfg.tie:
            dtype, got = self.ckpt.info(head)
            problems += self._check(head, dtype, got, (self.cfg.vocab, self.cfg.hidden), "plain")
        if problems:
            more = f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""
            raise RefError("bad checkpoint: " + "; ".join(problems[:12]) + more)

    def _check(self, full, dtype, got, shape, kind):
        allowed = {"plain": ("BF16", "F32"), "router": ("F32", "BF16"),
                   "linear": ("BF16", "F32", "F8_E4M3")}[kind]
        if dtype not in allowed:
            return [f"tensor {full} has dtype {dtype}, expected one of {', '.join(allowed)}"]
        if tuple(got) != tuple(shape):
            return [f"tensor {full} has shape {list(got)}, expected {list(shape)}"]
        if dtype == "F8_E4M3":
            sname = full + "_scale_inv"
            if sname not in self.ckpt:
                return [f"MXFP8 tensor {full} has no {sname}"]
            sd, ss = self.ckpt.info(sname)
            want = (shape[0], shape[1] // 32)
            if sd != "U8" or shape[1] % 32 or tuple(ss) != want:
                return [f"MXFP8 scale {sname} is {sd} {list(ss)}, expected U8 {list(want)}"]
        return []

    # -- weights ---------------------------------------------------------------
    def _to_f32(self, full):
        dtype, _ = self.ckpt.info(full)
        raw = self.ckpt.raw(full)
        if dtype == "BF16":
            return bf16_bits_to_f32(raw)
        if dtype == "F32":
            return np.array(raw, dtype=F32)
        if dtype == "F8_E4M3":
            return dequant_mxfp8(raw, self.ckpt.raw(full + "_scale_inv"))
        raise RefError(f"tensor {full} has unsupported dtype {dtype}")

    def w(self, suffix):
        """float32 copy of the tensor with this suffix (linear weights dequantised)."""
        if suffix in self._weights:
            return self._weights[suffix]
        full = self.name(suffix)
        if full is None:
            raise RefError(f"missing tensor {self.prefix}{suffix}")
        t = self._to_f32(full)
        if self.cache:
            self._weights[suffix] = t
        return t

    def embed_rows(self, tokens):
        """Embedding rows of the given token ids only (the table is never widened whole)."""
        full = self.prefix + "embed_tokens.weight"
        raw = self.ckpt.raw(full)[np.asarray(tokens)]
        return bf16_bits_to_f32(raw) if raw.dtype == np.uint16 else raw.astype(F32)

    def logits(self, x, chunk=32768):
        """x [R, H] (bf16-valued) times lm_head^T in fp32, lm_head widened in vocab chunks."""
        full = self.lm_head_name()
        raw = self.ckpt.raw(full)
        out = np.empty((x.shape[0], self.cfg.vocab), dtype=F32)
        for v0 in range(0, self.cfg.vocab, chunk):
            part = raw[v0:v0 + chunk]
            wt = bf16_bits_to_f32(part) if part.dtype == np.uint16 else part.astype(F32)
            out[:, v0:v0 + chunk] = mm(x, wt)
        return out


def load_model(model_dir, cache=None):
    """Parse config, open the checkpoint and validate every tensor the forward reads."""
    return Model(model_dir, cache=cache)


# --------------------------------------------------------------------------
# Elementary math (SPEC 2.3)
# --------------------------------------------------------------------------

F64 = np.float64

# Every product with a weight goes through mm(): float64 products and sums of
# the fp32 operands, cast to fp32 once (module docstring, convention 1).  The
# value is then (nearly) independent of summation order, so it no longer matters
# which BLAS kernel runs; the rows are still fed in blocks of a fixed number of
# rows (the last block zero-padded) so that even the float64 arithmetic of a
# row, and hence its result, is bit-for-bit the same whatever rows share the
# call (runs of different lengths agree exactly on their common rows).  The
# weight is widened to float64 in chunks of output columns to bound memory.
MM_ROWS = 64
MM_W_ELEMS = 1 << 22   # float64 weight elements widened at a time (32 MiB)


def mm(x, w):
    """x [R, K] @ w[N, K]^T: float64 accumulate, one rounding to fp32."""
    x = np.asarray(x, dtype=F32)
    w = np.asarray(w, dtype=F32)
    rows, kdim = x.shape
    n_out = w.shape[0]
    out = np.empty((rows, n_out), dtype=F32)
    ncol = max(1, MM_W_ELEMS // max(kdim, 1))
    with np.errstate(over="ignore"):  # a sum beyond fp32 range rounds to inf, as fp32 would
        for n0 in range(0, n_out, ncol):
            wt = w[n0:n0 + ncol].astype(F64).T
            for r0 in range(0, rows, MM_ROWS):
                blk = x[r0:r0 + MM_ROWS]
                n = blk.shape[0]
                blk = _pad_rows(blk, MM_ROWS).astype(F64)
                out[r0:r0 + n, n0:n0 + ncol] = (blk @ wt)[:n]
    return out


def _pad_rows(a, n):
    """a with zero rows appended up to n rows (unchanged when already that long)."""
    if a.shape[0] >= n:
        return a
    pad = np.zeros((n - a.shape[0],) + a.shape[1:], dtype=a.dtype)
    return np.concatenate([a, pad], axis=0)


RMS_ROWS = 4096  # rows widened to float64 at a time in rms_norm


def rms_norm(x, w, eps):
    """Gemma RMSNorm over the last axis: x * rsqrt(mean(x^2) + eps) * (1 + w).

    Convention 2: ms = f32(sum_f64(x^2) / dim); inv = f32(1) / sqrt(ms + f32(eps))
    in fp32; y = (x * inv) * (f32(1) + w) in fp32, in that order."""
    x = np.asarray(x, dtype=F32)
    dim = x.shape[-1]
    flat = x.reshape(-1, dim)
    ms = np.empty(flat.shape[0], dtype=F32)
    for r0 in range(0, flat.shape[0], RMS_ROWS):
        blk = flat[r0:r0 + RMS_ROWS].astype(F64)
        with np.errstate(over="ignore"):
            ms[r0:r0 + RMS_ROWS] = (np.sum(blk * blk, axis=-1) / dim).astype(F32)
    ms = ms.reshape(x.shape[:-1] + (1,))
    inv = F32(1.0) / np.sqrt(ms + F32(eps))
    return (x * inv) * (F32(1.0) + np.asarray(w, dtype=F32))


def rope_cos_sin(positions, rotary_dim, theta):
    """cos/sin [T, rotary_dim/2] as fp32, from angles formed in float64.

    At positions near 2^20 an fp32 angle is off by hundredths of a radian, so
    the spec forms position * inv_freq in double and rounds only cos/sin.
    """
    half = rotary_dim // 2
    inv_freq = float(theta) ** (-2.0 * np.arange(half, dtype=np.float64) / rotary_dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def apply_rope(x, cos, sin, rotary_dim):
    """NeoX RoPE on x [T, heads, d]: pairs (i, i + rotary_dim/2) for i < rotary_dim/2;
    dims >= rotary_dim are copied unchanged."""
    half = rotary_dim // 2
    out = np.array(x, dtype=F32, copy=True)
    x1 = out[..., :half].copy()
    x2 = out[..., half:rotary_dim].copy()
    c = cos[:, None, :]
    s = sin[:, None, :]
    out[..., :half] = x1 * c - x2 * s
    out[..., half:rotary_dim] = x2 * c + x1 * s
    return out


def exp_f32(x):
    """The correctly rounded fp32 exponential of fp32 x: f32(exp(double(x))).

    numpy's float32 exp is a SIMD approximation (up to 2 ulp off; it differs
    from libm expf on ~40% of inputs), so it is not used: any implementation
    can reproduce this value with (float)exp((double)x)."""
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, dtype=F32).astype(F64)).astype(F32)


def sigmoid(x):
    """1 / (1 + exp(-x)) in fp32 (exp as exp_f32)."""
    x = np.asarray(x, dtype=F32)
    return F32(1.0) / (F32(1.0) + exp_f32(-x))


def swiglu_oai(gate, up, alpha, limit):
    """act = g * sigmoid(alpha * g) * (u + 1), g = min(gate, limit), u = clamp(up, +-limit).
    np.minimum / np.clip propagate NaN, so a NaN input never turns into a number."""
    g = np.minimum(np.asarray(gate, dtype=F32), F32(limit))
    u = np.clip(np.asarray(up, dtype=F32), F32(-limit), F32(limit))
    return g * sigmoid(F32(alpha) * g) * (u + F32(1.0))


def swiglu_ffn(x, wg, wu, wd, alpha, limit):
    """Dense MLP / expert / shared expert, with the spec's four rounding points."""
    g = bf16_round(mm(x, wg))
    u = bf16_round(mm(x, wu))
    a = bf16_round(swiglu_oai(g, u, alpha, limit))
    return bf16_round(mm(a, wd))


# --------------------------------------------------------------------------
# Sparse attention: index scores and block selection (SPEC 3)
# --------------------------------------------------------------------------

def index_scale(index_dim):
    """index_dim^-0.5 * log2(e), formed in double and rounded once to fp32: the
    spec's 'then one multiply' is one fp32 multiply by this constant."""
    return F32(index_dim ** -0.5 * LOG2E)


def index_block_scores(iq, ik, q_pos, block_size):
    """Block scores [G, R, nb] for query rows at positions q_pos.

    iq [R, G, d] (normed, roped, bf16-valued), ik [Lk, d] with key j at position j;
    nb = ceil(Lk / block_size) covers every key given.  Convention 4: dot =
    f32(dot_f64(iq, ik)); score = (max over the block's visible keys, j < kv_len
    = pos + 1, of dot) * index_scale, one fp32 multiply; blocks with no visible
    key are -inf.  A NaN dot makes its block's score NaN (np.max propagates
    NaN), which selection then ranks lowest.
    """
    kv_len = np.asarray(q_pos) + 1
    lk = ik.shape[0]
    nb = -(-lk // block_size)
    dots = np.matmul(iq.transpose(1, 0, 2).astype(F64), ik.T.astype(F64)).astype(F32)  # [G, R, lk]
    visible = np.arange(lk)[None, :] < kv_len[:, None]
    full = np.full(dots.shape[:2] + (nb * block_size,), -np.inf, dtype=F32)
    full[..., :lk] = np.where(visible[None], dots, F32(-np.inf))
    best = full.reshape(dots.shape[0], dots.shape[1], nb, block_size).max(axis=-1)
    return best * index_scale(iq.shape[-1])


def select_blocks(scores, nblocks, topk, init_blocks, local_blocks):
    """Vectorised SPEC 3 selection.

    scores [..., nb] fp32; nblocks [...] = ceil(kv_len / block_size) visible
    blocks per row.  Returns int64 [..., topk]: ascending block ids, -1 padded.
    Ranking, best first: forced blocks (init b < init_blocks, local
    b >= nblocks - local_blocks), then ordinary visible blocks by score (with
    -inf below every finite score), then NaN-scored blocks, and invisible blocks
    never.  Every tie goes to the higher block id.  Forced blocks therefore
    count inside the top-k; should they ever outnumber topk, the higher
    (local) ones win by the same tie rule.
    """
    scores = np.asarray(scores, dtype=F32)
    nb = scores.shape[-1]
    b = np.arange(nb)
    nbl = np.asarray(nblocks)[..., None]
    visible = b < nbl
    forced = visible & ((b < init_blocks) | (b >= nbl - local_blocks))
    nan = np.isnan(scores)
    # Rank class: 3 forced, 2 scored, 1 NaN, 0 invisible (never chosen).
    cls = np.where(~visible, 0, np.where(forced, 3, np.where(nan, 1, 2)))
    val = np.where(cls == 2, scores, F32(0.0))
    bid = np.broadcast_to(b, scores.shape)
    cls = np.broadcast_to(cls, scores.shape)
    # lexsort: last key is primary; ascending, so the best block ends up last.
    order = np.lexsort((bid, val, cls), axis=-1)[..., ::-1][..., :topk]
    chosen = np.take_along_axis(cls, order, axis=-1) > 0
    big = np.iinfo(np.int64).max
    sel = np.sort(np.where(chosen, order, big), axis=-1)
    sel = np.where(sel == big, -1, sel).astype(np.int64)
    if sel.shape[-1] < topk:  # fewer blocks in the table than topk
        pad = np.full(sel.shape[:-1] + (topk - sel.shape[-1],), -1, dtype=np.int64)
        sel = np.concatenate([sel, pad], axis=-1)
    return sel


def select_blocks_row(scores, kv_len, block_size, topk, init_blocks, local_blocks):
    """One row's selection: scores [nb] (entries beyond the visible blocks ignored)."""
    nblocks = -(-int(kv_len) // block_size)
    return select_blocks(np.asarray(scores, dtype=F32)[None, :], np.array([nblocks]),
                         topk, init_blocks, local_blocks)[0]


def selection_mask(sel, nb):
    """Selected-block ids [..., topk] (-1 padded) -> boolean mask [..., nb]."""
    mask = np.zeros(sel.shape[:-1] + (nb + 1,), dtype=bool)
    np.put_along_axis(mask, np.where(sel < 0, nb, sel), True, axis=-1)
    return mask[..., :nb]


# --------------------------------------------------------------------------
# Attention core (dense and sparse share it, so sparse with every visible
# block selected is bit-identical to dense)
# --------------------------------------------------------------------------

# Query rows are processed in chunks of a fixed size (the last one padded with
# inert rows at position 0), and each chunk attends to a key range rounded up
# to a multiple of the same granule (zero-padded past the sequence, always
# masked).  All products then have fixed shapes per chunk, so row r's
# arithmetic never depends on how many tokens follow it: a prefix run
# reproduces the leading rows of a longer run bit for bit.
ROW_CHUNK = 64


def attention(q, k, v, q_pos, sparse=None, row_chunk=ROW_CHUNK):
    """GQA attention of query rows q [R, nh, hd] over keys k, v [Lk, G, hd]
    (key j at position j), each row masked to keys < pos + 1.

    sparse, when given, is a dict with iq [R, G, d], ik [Lk, d], block_size,
    topk, init_blocks, local_blocks: each row then also restricts KV group g
    to the blocks index head g selected for it.  Returns (out [R, nh, hd]
    bf16-valued per-head outputs, selections [G, R, topk] or None).
    """
    R, nh, hd = q.shape
    G = k.shape[1]
    hpg = nh // G
    q_pos = np.asarray(q_pos, dtype=np.int64)
    if q_pos.shape != (R,) or q_pos.min() < 0 or q_pos.max() >= k.shape[0]:
        raise RefError("attention: query positions must index existing keys")
    scale = F32(hd ** -0.5)
    r_pad = -(-R // row_chunk) * row_chunk
    kv_need = -(-(int(q_pos.max()) + 1) // row_chunk) * row_chunk
    q, pos_all = _pad_rows(q, r_pad), _pad_rows(q_pos, r_pad)
    k, v = _pad_rows(k, kv_need), _pad_rows(v, kv_need)
    out = np.empty((r_pad, nh, hd), dtype=F32)
    sels = None
    if sparse is not None:
        sels = np.full((G, r_pad, sparse["topk"]), -1, dtype=np.int64)
        iq, ik = _pad_rows(sparse["iq"], r_pad), _pad_rows(sparse["ik"], kv_need)
    for r0 in range(0, r_pad, row_chunk):
        r1 = r0 + row_chunk
        pos = pos_all[r0:r1]
        kv_len = pos + 1
        lk = -(-int(kv_len.max()) // row_chunk) * row_chunk
        key = np.arange(lk)
        allowed = np.broadcast_to((key[None, :] < kv_len[:, None])[None], (G, row_chunk, lk))
        if sparse is not None:
            bs = sparse["block_size"]
            scores = index_block_scores(iq[r0:r1], ik[:lk], pos, bs)
            nblocks = -(-kv_len // bs)
            sel = select_blocks(scores, nblocks[None, :], sparse["topk"],
                                sparse["init_blocks"], sparse["local_blocks"])
            sels[:, r0:r1] = sel
            mask = selection_mask(sel, scores.shape[-1])               # [G, rows, nb]
            allowed = allowed & mask[:, :, key // bs]
        for g in range(G):
            # Convention 3: f64 dots and sums, each rounded once to fp32.
            qg = q[r0:r1, g * hpg:(g + 1) * hpg].transpose(1, 0, 2).astype(F64)  # [hpg, rows, hd]
            s = np.matmul(qg, k[:lk, g].T.astype(F64)).astype(F32) * scale      # [hpg, rows, lk]
            s = np.where(allowed[g][None], s, F32(-np.inf))
            m = s.max(axis=-1, keepdims=True)
            e = exp_f32(s - m)
            tot = e.sum(axis=-1, keepdims=True, dtype=F64).astype(F32)
            p = e / tot
            o = np.matmul(p.astype(F64), v[:lk, g].astype(F64)).astype(F32)
            out[r0:r1, g * hpg:(g + 1) * hpg] = o.transpose(1, 0, 2)
    out = out[:R]
    if sels is not None:
        sels = sels[:, :R]
    return bf16_round(out), sels


# --------------------------------------------------------------------------
# Layer blocks
# --------------------------------------------------------------------------

def _heads_norm_rope(x, n, d, w, eps, cos, sin, rotary_dim):
    """Projection output [T, n*d] -> per-head Gemma norm, RoPE, one bf16 rounding."""
    t = x.reshape(x.shape[0], n, d)
    return bf16_round(apply_rope(rms_norm(t, w, eps), cos, sin, rotary_dim))


def attention_block(model, i, x, pos, cos, sin, trace=None):
    c = model.cfg
    L = f"layers.{i}.self_attn."
    T = x.shape[0]
    q = bf16_round(mm(x, model.w(L + "q_proj.weight")))
    k = bf16_round(mm(x, model.w(L + "k_proj.weight")))
    v = bf16_round(mm(x, model.w(L + "v_proj.weight"))).reshape(T, c.n_kv, c.head_dim)
    q = _heads_norm_rope(q, c.n_heads, c.head_dim, model.w(L + "q_norm.weight"), c.eps, cos, sin, c.rotary_dim)
    k = _heads_norm_rope(k, c.n_kv, c.head_dim, model.w(L + "k_norm.weight"), c.eps, cos, sin, c.rotary_dim)
    sparse = None
    if c.sparse[i]:
        iq = bf16_round(mm(x, model.w(L + "index_q_proj.weight")))
        ik = bf16_round(mm(x, model.w(L + "index_k_proj.weight")))
        iq = _heads_norm_rope(iq, c.n_index_heads, c.index_dim, model.w(L + "index_q_norm.weight"),
                              c.eps, cos, sin, c.rotary_dim)
        ik = _heads_norm_rope(ik, 1, c.index_dim, model.w(L + "index_k_norm.weight"),
                              c.eps, cos, sin, c.rotary_dim)[:, 0]
        sparse = dict(iq=iq, ik=ik, block_size=c.block_size, topk=c.topk_blocks,
                      init_blocks=c.init_blocks, local_blocks=c.local_blocks)
    o, sels = attention(q, k, v, pos, sparse)
    if trace is not None:
        trace[f"L{i}.q"], trace[f"L{i}.k"], trace[f"L{i}.v"] = q, k, v
        trace[f"L{i}.attn_heads"] = o
        if sels is not None:
            trace[f"L{i}.select"] = sels
    return bf16_round(mm(o.reshape(T, c.n_heads * c.head_dim), model.w(L + "o_proj.weight")))


def route(logits, bias, k):
    """Sigmoid router: top-k by s + bias (ties -> lower expert id, NaN lowest),
    weights s_i / sum of chosen s.  Returns (ids [T, k], weights [T, k] fp32)."""
    s = sigmoid(logits)
    key = s + bias if bias is not None else s
    # A stable ascending sort of -key keeps lower ids first among equal keys;
    # NaN sorts last, i.e. is chosen last.
    ids = np.argsort(-key, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(s, ids, axis=-1)
    tot = chosen[:, :1].copy()
    for j in range(1, chosen.shape[1]):  # fp32 sum in routing-rank order (explicit:
        tot += chosen[:, j:j + 1]        # np.sum goes pairwise from 8 terms on)
    return ids, chosen / tot


def moe_block(model, i, x, trace=None):
    c = model.cfg
    M = f"layers.{i}.block_sparse_moe."
    logits = mm(x, model.w(M + "gate.weight"))   # fp32 router weight and math
    bias = model.w(M + "e_score_correction_bias").astype(F32) if c.use_bias else None
    ids, wts = route(logits, bias, c.topk_experts)
    T, H = x.shape
    expert_out = np.zeros((T, c.topk_experts, H), dtype=F32)
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        E = f"{M}experts.{e}."
        expert_out[rows, slots] = swiglu_ffn(x[rows], model.w(E + "w1.weight"), model.w(E + "w3.weight"),
                                             model.w(E + "w2.weight"), c.swiglu_alpha, c.swiglu_limit)
    acc = np.zeros((T, H), dtype=F32)
    for j in range(c.topk_experts):  # fp32 sum in routing-rank order
        acc += wts[:, j:j + 1] * expert_out[:, j]
    y = F32(c.rsf) * acc
    if c.n_shared:
        S = M + "shared_experts."
        y = y + swiglu_ffn(x, model.w(S + "gate_proj.weight"), model.w(S + "up_proj.weight"),
                           model.w(S + "down_proj.weight"), c.swiglu_alpha, c.swiglu_limit)
    if trace is not None:
        trace[f"L{i}.router_logits"], trace[f"L{i}.experts"], trace[f"L{i}.expert_weights"] = logits, ids, wts
    return bf16_round(y)


def mlp_block(model, i, x):
    c = model.cfg
    P = f"layers.{i}.mlp."
    return swiglu_ffn(x, model.w(P + "gate_proj.weight"), model.w(P + "up_proj.weight"),
                      model.w(P + "down_proj.weight"), c.swiglu_alpha, c.swiglu_limit)


# --------------------------------------------------------------------------
# Whole model
# --------------------------------------------------------------------------

def forward_logits(model, tokens, prompt_len=1, trace=None, taps=None):
    """Teacher-forced forward of one request (positions 0..L-1).

    Returns fp32 logits [L - prompt_len + 1, vocab]; row i is the logits at
    position prompt_len - 1 + i.  If `trace` is a dict it receives per-layer
    tensors ('L{i}.residual' after the attention add, 'L{i}.hidden' = FFN
    output, 'L{i}.select' [G, L, topk] on sparse layers, router choices on MoE
    layers, 'final_norm').  If `taps` is a dict, each of its keys that is a
    layer id i gets the residual stream after that layer, bf16(hidden_i +
    residual_i) [L, H] (the input of layer i + 1, or what the final norm reads
    after the last layer): the DSpark drafter's taps (docs/DSPARK.md).
    """
    c = model.cfg
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    L = tokens.shape[0]
    if L == 0:
        raise RefError("no tokens given")
    if not 1 <= prompt_len <= L:
        raise RefError(f"prompt length {prompt_len} must be in 1..{L} (number of tokens)")
    bad = tokens[(tokens < 0) | (tokens >= c.vocab)]
    if bad.size:
        raise RefError(f"token id {int(bad[0])} outside the vocabulary [0, {c.vocab})")
    pos = np.arange(L, dtype=np.int64)
    cos, sin = rope_cos_sin(pos, c.rotary_dim, c.rope_theta)

    hidden = bf16_round(model.embed_rows(tokens))
    residual = None
    for i in range(c.n_layers):
        # Layer 0: residual = hidden = embedding; later layers add first.
        residual = hidden if residual is None else bf16_round(hidden + residual)
        x = bf16_round(rms_norm(residual, model.w(f"layers.{i}.input_layernorm.weight"), c.eps))
        attn = attention_block(model, i, x, pos, cos, sin, trace)
        residual = bf16_round(residual + attn)
        x = bf16_round(rms_norm(residual, model.w(f"layers.{i}.post_attention_layernorm.weight"), c.eps))
        hidden = moe_block(model, i, x, trace) if c.moe[i] else mlp_block(model, i, x)
        if trace is not None:
            trace[f"L{i}.residual"], trace[f"L{i}.hidden"] = residual, hidden
        if taps is not None and i in taps:
            taps[i] = bf16_round(hidden + residual)
    final = bf16_round(hidden + residual)
    out = bf16_round(rms_norm(final, model.w("norm.weight"), c.eps))
    if trace is not None:
        trace["final_norm"] = out
    # Start the lm_head product on an MM_ROWS boundary so each row sits at the
    # same place in its block whatever the prompt length (bitwise-stable rows).
    start = (prompt_len - 1) // MM_ROWS * MM_ROWS
    return model.logits(out[start:])[prompt_len - 1 - start:]


def greedy_tokens(logits):
    """Argmax per row, ties -> lowest id (np.argmax takes the first); NaN never wins."""
    return np.argmax(np.where(np.isnan(logits), -np.inf, logits), axis=-1)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def _parse_tokens(text):
    if text.startswith("@"):  # @FILE: a long token list kept in a file
        try:
            with open(text[1:]) as f:
                text = f.read()
        except OSError as e:
            raise RefError(f"cannot read token file {text[1:]}: {e}") from e
    try:
        return [int(t) for t in text.replace("\n", ",").split(",") if t.strip()]
    except ValueError as e:
        raise RefError(f"--tokens must be comma-separated integers: {e}") from e


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint folder (config.json + safetensors)")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids, or @FILE")
    ap.add_argument("--prompt-len", type=int, required=True, help="P: logits from position P-1 on")
    ap.add_argument("--out", required=True, help="output .npy, float32 [L-P+1, vocab]")
    ap.add_argument("--greedy", action="store_true", help="print each row's argmax token")
    ap.add_argument("--trace", help="also save per-layer tensors and selections to this .npz")
    args = ap.parse_args(argv)
    try:
        tokens = _parse_tokens(args.tokens)
        model = load_model(args.model)
        trace = {} if args.trace else None
        logits = forward_logits(model, tokens, args.prompt_len, trace)
        np.save(args.out, logits.astype(F32))
        if trace is not None:
            np.savez(args.trace, **trace)
    except RefError as e:
        print(f"m3_ref: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"m3_ref: error: {e}", file=sys.stderr)
        return 2
    if args.greedy:
        print(",".join(str(int(t)) for t in greedy_tokens(logits)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
