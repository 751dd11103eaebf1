#!/usr/bin/env python3
"""Self-checks of the numpy MiniMax-M3 reference (m3_ref.py), no C engine needed.

The reference is only useful as an oracle if its own pieces are right, so this
file pins each rule of SPEC 2.3 / 3 that is easy to get subtly wrong (bf16
round-to-even, e4m3 decoding, Gemma norm, NeoX RoPE, block selection and router
tie rules, SwiGLU clamps) against hand values or a direct formula, pins the
"f64 accumulate, round once to fp32" convention (matrix products equal the
fp32 rounding of the exact sum, bitwise independent of row blocking and row
order; the norm's stated order; the correctly rounded exp), checks the
vectorised sparse attention bit for bit against a slow per-row loop written
separately here with math.fsum sums, and runs end-to-end checks on tiny random checkpoints that it writes
itself (its own safetensors writer, bf16 and MXFP8, single-file and sharded):
sparse attention with top-k >= visible blocks equals dense, runs are
deterministic, a prefix reproduces the leading rows of a longer run, MXFP8 and
sharding load to the same model, and the command line writes what it promises
and fails cleanly (exit 2) on a bad checkpoint.

Run: python3 tests/reference/test_m3_ref.py   (exit status non-zero on failure)
"""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import m3_ref as R  # noqa: E402

F32 = np.float32
F64 = np.float64


# --------------------------------------------------------------------------
# Checkpoint writer (test-side, independent of the reader in m3_ref)
# --------------------------------------------------------------------------

def f32_bits(x):
    return np.asarray(x, dtype=F32).view(np.uint32)


def to_bf16_bits(x):
    """float32 values that are already bf16-representable -> uint16 patterns."""
    bits = f32_bits(x)
    assert not np.any(bits & 0xFFFF), "value not bf16-representable"
    return (bits >> 16).astype(np.uint16)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, array).  BF16 takes bf16-valued float32 arrays;
    F32 float32; F8_E4M3 / U8 / F16 raw uint8 / float16 arrays."""
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        if dtype == "BF16":
            data = to_bf16_bits(arr).tobytes()
        elif dtype == "F32":
            data = np.asarray(arr, dtype="<f4").tobytes()
        elif dtype in ("F8_E4M3", "U8"):
            data = np.asarray(arr, dtype=np.uint8).tobytes()
        elif dtype == "F16":
            data = np.asarray(arr, dtype="<f2").tobytes()
        else:
            raise ValueError(dtype)
        header[name] = {"dtype": dtype, "shape": list(np.shape(arr)), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = {"format": "pt"}
    hj = json.dumps(header).encode()
    hj += b" " * (-len(hj) % 8)  # keep the data 8-byte aligned, like real writers
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def tiny_config(**over):
    """4 layers covering every (attention, FFN) combination:
    dense+dense, sparse+MoE, dense+MoE, sparse+dense."""
    cfg = {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "partial_rotary_factor": 0.5,
        "vocab_size": 97, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "intermediate_size": 24, "dense_intermediate_size": 48,
        "shared_intermediate_size": 32, "n_shared_experts": 1,
        "num_local_experts": 6, "num_experts_per_tok": 2,
        "moe_layer_freq": [0, 1, 1, 0], "scoring_func": "sigmoid", "use_routing_bias": True,
        "routed_scaling_factor": 2.0, "hidden_act": "swigluoai",
        "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "use_gemma_norm": True,
        "qk_norm_type": "per_head", "tie_word_embeddings": False,
        "sparse_attention_config": {
            "sparse_attention_freq": [0, 1, 0, 1], "sparse_num_index_heads": 2,
            "sparse_index_dim": 16, "sparse_block_size": 16, "sparse_topk_blocks": 3,
            "sparse_init_block": 1, "sparse_local_block": 1, "sparse_score_type": "max",
            "sparse_disable_index_value": True,
        },
    }
    sac = over.pop("sparse", {})
    cfg["sparse_attention_config"].update(sac)
    cfg.update(over)
    return cfg


def tiny_weights(cfg, seed=0):
    """suffix -> float32 array (bf16-valued except the fp32 router), scaled so
    activations stay O(1) through the layers."""
    rng = np.random.default_rng(seed)
    H, nh, G, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sac = cfg["sparse_attention_config"]
    idim, V = sac["sparse_index_dim"], cfg["vocab_size"]

    def lin(n, k):
        return R.bf16_round(rng.standard_normal((n, k)).astype(F32) / np.sqrt(k))

    def nrm(n):
        return R.bf16_round(0.2 * rng.standard_normal(n).astype(F32))

    w = {"embed_tokens.weight": R.bf16_round(rng.standard_normal((V, H)).astype(F32)),
         "norm.weight": nrm(H), "LM_HEAD": lin(V, H)}
    for i in range(cfg["num_hidden_layers"]):
        L = f"layers.{i}."
        w[L + "input_layernorm.weight"] = nrm(H)
        w[L + "post_attention_layernorm.weight"] = nrm(H)
        w[L + "self_attn.q_proj.weight"] = lin(nh * hd, H)
        w[L + "self_attn.k_proj.weight"] = lin(G * hd, H)
        w[L + "self_attn.v_proj.weight"] = lin(G * hd, H)
        w[L + "self_attn.o_proj.weight"] = lin(H, nh * hd)
        w[L + "self_attn.q_norm.weight"] = nrm(hd)
        w[L + "self_attn.k_norm.weight"] = nrm(hd)
        # Index weights on every layer: dense layers simply ignore them, which
        # lets one weight set serve both the sparse and the all-dense config.
        w[L + "self_attn.index_q_proj.weight"] = lin(G * idim, H)
        w[L + "self_attn.index_k_proj.weight"] = lin(idim, H)
        w[L + "self_attn.index_q_norm.weight"] = nrm(idim)
        w[L + "self_attn.index_k_norm.weight"] = nrm(idim)
        if cfg["moe_layer_freq"][i]:
            M = L + "block_sparse_moe."
            E, I, Is = cfg["num_local_experts"], cfg["intermediate_size"], cfg["shared_intermediate_size"]
            w[M + "gate.weight"] = (rng.standard_normal((E, H)) / np.sqrt(H)).astype(F32)
            w[M + "e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(F32)
            for e in range(E):
                w[f"{M}experts.{e}.w1.weight"] = lin(I, H)
                w[f"{M}experts.{e}.w3.weight"] = lin(I, H)
                w[f"{M}experts.{e}.w2.weight"] = lin(H, I)
            w[M + "shared_experts.gate_proj.weight"] = lin(Is, H)
            w[M + "shared_experts.up_proj.weight"] = lin(Is, H)
            w[M + "shared_experts.down_proj.weight"] = lin(H, Is)
        else:
            Id = cfg["dense_intermediate_size"]
            w[L + "mlp.gate_proj.weight"] = lin(Id, H)
            w[L + "mlp.up_proj.weight"] = lin(Id, H)
            w[L + "mlp.down_proj.weight"] = lin(H, Id)
    return w


def write_model(d, cfg, weights, prefix="language_model.model.", lm_head="language_model.lm_head.weight",
                shards=1, nest=False, mxfp8=None, drop=(), override=None):
    """Write config.json and the checkpoint.  mxfp8: suffix -> (bytes, scales)
    stored as F8_E4M3 + U8 instead of bf16.  drop: suffixes left out.
    override: full name -> (dtype, array) replacing a tensor."""
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "minimax_m3_vl", "text_config": cfg} if nest else cfg, f)
    tensors = {}
    for suffix, arr in weights.items():
        if suffix in drop:
            continue
        if suffix == "LM_HEAD":
            tensors[lm_head] = ("BF16", arr)
            continue
        full = prefix + suffix
        if mxfp8 and suffix in mxfp8:
            raw, scale = mxfp8[suffix]
            tensors[full] = ("F8_E4M3", raw)
            tensors[full + "_scale_inv"] = ("U8", scale)
        elif suffix.endswith("gate.weight") and "block_sparse_moe" in suffix or suffix.endswith("correction_bias"):
            tensors[full] = ("F32", arr)
        else:
            tensors[full] = ("BF16", arr)
    tensors["mtp.layers.0.junk"] = ("F16", np.zeros(3, np.float16))  # skipped: never read
    tensors.update(override or {})
    names = list(tensors)
    if shards == 1:
        write_safetensors(os.path.join(d, "model.safetensors"), tensors)
        return
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        write_safetensors(os.path.join(d, fname), part)
        weight_map.update({n: fname for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def logits_of(d, tokens, prompt_len=1, **kw):
    return R.forward_logits(R.load_model(d), tokens, prompt_len, **kw)


# --------------------------------------------------------------------------
# Number formats and elementary math
# --------------------------------------------------------------------------

class NumberFormats(unittest.TestCase):
    def test_bf16_round_to_even(self):
        one = 1.0
        cases = [
            (one, one),
            (one + 2 ** -8, one),                    # exact half, even (0) kept
            (one + 3 * 2 ** -8, one + 2 ** -6),      # exact half, rounds to even mantissa 2
            (one + 2 ** -8 + 2 ** -20, one + 2 ** -7),  # just above half: up
            (one + 2 ** -8 - 2 ** -20, one),         # just below half: down
            (-(one + 3 * 2 ** -8), -(one + 2 ** -6)),
            (3.0, 3.0), (0.0, 0.0),
            (2 ** -149, 0.0),                        # fp32 min subnormal -> 0
            (3.3895314e38, 3.3895314e38),            # largest finite bf16 stays
            (3.4028235e38, np.inf),                  # largest fp32 rounds up to inf
        ]
        for x, want in cases:
            got = R.bf16_round(np.float32(x))
            self.assertEqual(float(got), float(np.float32(want)), f"bf16_round({x!r})")
        neg0 = R.bf16_round(np.float32(-0.0))
        self.assertTrue(np.signbit(neg0) and neg0 == 0)

    def test_bf16_specials(self):
        self.assertEqual(float(R.bf16_round(np.float32(np.inf))), np.inf)
        self.assertEqual(float(R.bf16_round(np.float32(-np.inf))), -np.inf)
        # NaNs whose payload sits only in the dropped low bits must stay NaN.
        for bits in (0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F80FFFF):
            x = np.array([bits], dtype=np.uint32).view(F32)
            self.assertTrue(np.isnan(R.bf16_round(x))[0], hex(bits))
        a = np.array([[1.0, np.nan], [2 ** -8 + 1, -7.0]], dtype=F32)
        out = R.bf16_round(a)
        self.assertEqual(out.shape, a.shape)
        self.assertEqual(out.dtype, F32)
        self.assertTrue(np.isnan(out[0, 1]))
        # Every result is a bf16 value and rounding is idempotent.
        rng = np.random.default_rng(1)
        x = (rng.standard_normal(10000) * 10.0 ** rng.integers(-30, 30, 10000)).astype(F32)
        y = R.bf16_round(x)
        self.assertFalse(np.any(y.view(np.uint32) & 0xFFFF))
        np.testing.assert_array_equal(R.bf16_round(y), y)
        self.assertTrue(np.all(np.abs(y - x) <= np.abs(x) * 2 ** -8))

    def test_e4m3_decode(self):
        known = {0x00: 0.0, 0x38: 1.0, 0x40: 2.0, 0x3C: 1.5, 0xB8: -1.0, 0x01: 2 ** -9,
                 0x07: 7 * 2 ** -9, 0x08: 2 ** -6, 0x7E: 448.0, 0xFE: -448.0, 0x30: 0.5,
                 0x77: 240.0}
        raw = np.array(list(known), dtype=np.uint8)
        got = R.e4m3_to_float(raw)
        np.testing.assert_array_equal(got, np.array(list(known.values()), dtype=F32))
        neg0 = R.e4m3_to_float(np.array([0x80], np.uint8))[0]
        self.assertTrue(neg0 == 0 and np.signbit(neg0))
        self.assertTrue(np.all(np.isnan(R.e4m3_to_float(np.array([0x7F, 0xFF], np.uint8)))))
        self.assertEqual(int(np.isnan(R.e4m3_to_float(np.arange(256, dtype=np.uint8))).sum()), 2)

    def test_mxfp8_dequant(self):
        raw = np.full((2, 64), 0x38, np.uint8)            # all 1.0
        raw[1, 40] = 0xC0                                 # -2.0
        scale = np.array([[127, 130], [120, 0]], np.uint8)
        w = R.dequant_mxfp8(raw, scale)
        self.assertEqual(w[0, 0], 1.0)
        self.assertEqual(w[0, 33], 8.0)
        self.assertEqual(w[1, 0], 2.0 ** -7)
        self.assertEqual(w[1, 40], -2.0 * 2.0 ** -127)
        self.assertTrue(np.isnan(R.dequant_mxfp8(raw[:1], np.array([[255, 127]], np.uint8))[0, 0]))
        with self.assertRaises(R.RefError):
            R.dequant_mxfp8(raw, scale[:, :1])


class ElementaryMath(unittest.TestCase):
    def test_gemma_rmsnorm(self):
        x = np.array([1.0, 2.0, 3.0, 4.0], F32)
        w = np.array([0.0, 0.5, -0.5, 1.0], F32)
        # mean(x^2) = 7.5, so y = x / sqrt(7.5 + 1e-6) * (1 + w)
        want = np.array([1.0, 3.0, 1.5, 8.0]) / math.sqrt(7.5 + 1e-6)
        got = R.rms_norm(x, w, 1e-6)
        self.assertEqual(got.dtype, F32)
        np.testing.assert_allclose(got, want, rtol=2e-7)
        np.testing.assert_allclose(got[:1], [0.36514837], rtol=1e-6)
        # Per-head use: normalises over the last axis only.
        t = np.stack([x, 10 * x])[None]
        np.testing.assert_allclose(R.rms_norm(t, w, 0.0)[0, 1], R.rms_norm(x, w, 0.0), rtol=1e-6)

    def test_gemma_rmsnorm_stated_order(self):
        """ms = f32(sum_f64(x^2) / dim); inv = 1 / sqrt(ms + f32(eps)) in fp32;
        y = (x * inv) * (1 + w) in fp32, in that order: bitwise."""
        rng = np.random.default_rng(11)
        eps = 1e-6
        x = R.bf16_round((rng.standard_normal((5, 3, 128)) * 3).astype(F32))
        w = R.bf16_round((0.2 * rng.standard_normal(128)).astype(F32))
        ms = np.array([F32(math.fsum(float(v) ** 2 for v in row) / 128) for row in x.reshape(-1, 128)],
                      F32).reshape(5, 3, 1)
        inv = F32(1.0) / np.sqrt(ms + F32(eps))
        want = (x * inv) * (F32(1.0) + w)
        got = R.rms_norm(x, w, eps)
        self.assertEqual(got.dtype, F32)
        np.testing.assert_array_equal(got, want)
        self.assertFalse(np.array_equal(got, x * (inv * (F32(1.0) + w))))  # the order matters
        # The sum of squares is not an fp32 sum: 8192^2 + 7 * 1 = 2^26 + 7 keeps
        # its 7 in float64 (ms = 2^23 + 1 after the one rounding), an fp32
        # accumulation drops it (ms = 2^23).
        x = np.array([8192.0] + [1.0] * 7, F32)
        w = np.zeros(8, F32)
        inv = F32(1.0) / np.sqrt(F32(2 ** 23 + 1) + F32(eps))
        np.testing.assert_array_equal(R.rms_norm(x, w, eps), x * inv)
        inv32 = F32(1.0) / np.sqrt(np.mean(x * x, dtype=F32) + F32(eps))
        self.assertNotEqual(inv, inv32)

    def test_exp_is_correctly_rounded(self):
        rng = np.random.default_rng(12)
        x = np.concatenate([(-rng.random(3000) * 40), rng.standard_normal(3000) * 10,
                            [0.0, -0.0, -104.0, 88.7, 89.0, -np.inf, np.inf, np.nan]]).astype(F32)
        got = R.exp_f32(x)
        self.assertEqual(got.dtype, F32)
        with np.errstate(over="ignore"):
            want = np.array([math.inf if v >= 710 else math.exp(float(v)) for v in x]).astype(F32)
        np.testing.assert_array_equal(got, want)   # libm double exp, rounded once
        s = R.sigmoid(np.array([0.0, 100.0, -100.0, -1000.0], F32))
        np.testing.assert_array_equal(s, np.array([0.5, 1.0, 0.0, 0.0], F32))  # exp(100) overflows fp32


def exact_products(x, w):
    """x [R, K] @ w [N, K]^T as the fp32 rounding of math.fsum of the float64
    products (exact: fp32 x fp32 fits a double), element by element."""
    x64, w64 = np.asarray(x, F64), np.asarray(w, F64)
    return np.array([[F32(math.fsum(x64[i] * w64[j])) for j in range(w64.shape[0])]
                     for i in range(x64.shape[0])], F32).reshape(x64.shape[0], w64.shape[0])


def bf16_limited(rng, shape, emin=-4, emax=3):
    """bf16 values +-m * 2^e with an 8-bit significand m and e in [emin, emax]:
    products and sums of up to ~2^20 of them are exact in float64."""
    m = rng.integers(128, 256, shape).astype(F64)
    e = rng.integers(emin, emax + 1, shape)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    return (sign * np.ldexp(m, e - 7)).astype(F32)


class MatrixProducts(unittest.TestCase):
    """Convention 1: float64 products and sums, one rounding to fp32."""

    def test_mm_equals_fp32_of_f64_sum(self):
        rng = np.random.default_rng(13)
        # Data whose float64 sum is exact in any order: mm must equal the fp32
        # rounding of the exact sum whatever the BLAS does.
        x, w = bf16_limited(rng, (70, 96)), bf16_limited(rng, (40, 96))
        got = R.mm(x, w)
        self.assertEqual(got.dtype, F32)
        np.testing.assert_array_equal(got, exact_products(x, w))
        np.testing.assert_array_equal(got, (x.astype(F64) @ w.astype(F64).T).astype(F32))
        # General data: bf16 activations against an fp32 (router-like) weight
        # and bf16 x bf16, both long sums.
        x = R.bf16_round(rng.standard_normal((33, 300)).astype(F32))
        for w in (rng.standard_normal((20, 300)).astype(F32) / 17,
                  R.bf16_round(rng.standard_normal((20, 300)).astype(F32))):
            np.testing.assert_array_equal(R.mm(x, w), exact_products(x, w))

    def test_mm_rounds_once(self):
        # fp32 accumulation would give 1 + 2^-24 -> 1, + 2^-24 -> 1; the exact sum
        # 1 + 2^-23 is an fp32 number.  And a cancelling sum keeps its small terms.
        x = np.array([[1.0, 2.0 ** -24, 2.0 ** -24, 0.0], [2.0 ** 24, 1.0, -(2.0 ** 24), 1.0]], F32)
        w = np.ones((1, 4), F32)
        np.testing.assert_array_equal(R.mm(x, w), np.array([[1 + 2.0 ** -23], [2.0]], F32))

    def test_mm_independent_of_blocking_and_row_order(self):
        rng = np.random.default_rng(14)
        x = R.bf16_round(rng.standard_normal((150, 200)).astype(F32))
        w = R.bf16_round(rng.standard_normal((90, 200)).astype(F32))
        base = R.mm(x, w)
        perm = rng.permutation(150)
        np.testing.assert_array_equal(R.mm(x[perm], w), base[perm])
        for n in (1, 5, 63, 64, 65, 149):
            np.testing.assert_array_equal(R.mm(x[:n], w), base[:n], err_msg=f"{n} rows")
            np.testing.assert_array_equal(R.mm(x[-n:], w), base[-n:], err_msg=f"last {n} rows")
        for rows in (1, 7, 64, 256):
            for welems in (200 * 3, 1 << 22):   # 3 output columns per weight chunk, or all
                with mock.patch.object(R, "MM_ROWS", rows), mock.patch.object(R, "MM_W_ELEMS", welems):
                    np.testing.assert_array_equal(R.mm(x, w), base, err_msg=f"MM_ROWS={rows} {welems}")
                    np.testing.assert_array_equal(R.mm(x[perm], w), base[perm])

    def test_rope_formula(self):
        rd, d, theta = 8, 16, 5e6
        pos = np.array([0, 1, 7, 1000, 2 ** 20 - 1], np.int64)
        rng = np.random.default_rng(2)
        x = rng.standard_normal((len(pos), 3, d)).astype(F32)
        cos, sin = R.rope_cos_sin(pos, rd, theta)
        self.assertEqual(cos.dtype, F32)
        out = R.apply_rope(x, cos, sin, rd)
        # Dims >= rotary_dim untouched (bitwise); position 0 is the identity.
        np.testing.assert_array_equal(out[..., rd:], x[..., rd:])
        np.testing.assert_array_equal(out[0], x[0])
        h = rd // 2
        for t, p in enumerate(pos):
            for i in range(h):
                ang = p * theta ** (-2.0 * i / rd)
                c, s = math.cos(ang), math.sin(ang)
                np.testing.assert_allclose(out[t, :, i], x[t, :, i] * c - x[t, :, i + h] * s, atol=1e-5)
                np.testing.assert_allclose(out[t, :, i + h], x[t, :, i + h] * c + x[t, :, i] * s, atol=1e-5)
        # The angle is formed in double: at 2^20 an fp32 angle would be visibly off.
        p, inv = 2 ** 20 - 1, 1.0
        self.assertAlmostEqual(float(cos[-1, 0]), math.cos(p * inv), places=6)

    def test_swiglu_oai_clamps(self):
        a, lim = 1.702, 7.0

        def ref(g, u):
            g = min(g, lim)
            u = max(-lim, min(u, lim))
            return g / (1 + math.exp(-a * g)) * (u + 1)

        gate = np.array([10.0, -10.0, 0.5, 7.0, -3.0, 10.0], F32)
        up = np.array([10.0, -10.0, 0.5, 100.0, 2.0, -7.5], F32)
        got = R.swiglu_oai(gate, up, a, lim)
        want = [ref(float(g), float(u)) for g, u in zip(gate, up)]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
        self.assertAlmostEqual(float(got[0]), 7 / (1 + math.exp(-a * 7)) * 8, places=4)  # both clamped
        # gate is not clamped from below: -10 gives a different value than -7 would
        self.assertGreater(abs(float(got[1]) - ref(-7.0, -10.0)), 1e-4)
        self.assertAlmostEqual(float(got[5]), ref(10.0, -7.0), places=4)  # up clamped at -7: (u + 1) = -6
        self.assertTrue(np.isnan(R.swiglu_oai(np.array([np.nan], F32), np.array([1.0], F32), a, lim))[0])


# --------------------------------------------------------------------------
# Selection rules
# --------------------------------------------------------------------------

def sel_row(scores, kv_len, bs=4, topk=3, init=0, local=1):
    return list(R.select_blocks_row(np.array(scores, F32), kv_len, bs, topk, init, local))


class SelectionRules(unittest.TestCase):
    def test_forced_blocks_count_inside_topk(self):
        # 6 visible blocks, block 0 init, block 5 local: only one slot left -> best (block 2).
        self.assertEqual(sel_row([0, 1, 9, 8, 7, -5], 24, topk=3, init=1, local=1), [0, 2, 5])
        # no init block: two free slots
        self.assertEqual(sel_row([0, 1, 9, 8, 7, -5], 24, topk=3, init=0, local=1), [2, 3, 5])
        # two local blocks
        self.assertEqual(sel_row([0, 1, 9, 8, 7, -5], 24, topk=3, init=0, local=2), [2, 4, 5])

    def test_ties_go_to_higher_block(self):
        self.assertEqual(sel_row([1, 1, 1, 1, 1, 1], 24, topk=3, init=0, local=1), [3, 4, 5])
        self.assertEqual(sel_row([2, 1, 2, 0, 2, 0], 24, topk=3, init=0, local=1), [2, 4, 5])
        self.assertEqual(sel_row([-0.0, 0.0, 0.0, -0.0, 5, 0], 24, topk=3, init=0, local=1), [3, 4, 5])

    def test_fewer_visible_than_topk(self):
        # kv_len 5 with block 4: blocks 0, 1 visible; the rest must not be chosen
        # even though they carry high (stale) scores.
        self.assertEqual(sel_row([-np.inf, 3, 99, 99], 5, topk=3), [0, 1, -1])
        self.assertEqual(sel_row([np.nan], 1, topk=4), [0, -1, -1, -1])
        self.assertEqual(sel_row([5, 6], 8, topk=16), [0, 1] + [-1] * 14)

    def test_nan_lowest(self):
        # NaN below -inf, below everything; but still selected when slots remain.
        self.assertEqual(sel_row([np.nan, -np.inf, 0, 0, 0], 20, topk=2, init=0, local=1), [3, 4])
        self.assertEqual(sel_row([np.nan, -np.inf, 1, 0, 0], 20, topk=3, init=0, local=1), [2, 3, 4])
        self.assertEqual(sel_row([np.nan, -np.inf, 1, 0, 0], 20, topk=4, init=0, local=1), [1, 2, 3, 4])
        self.assertEqual(sel_row([np.nan, -np.inf, 1, 0, 0], 20, topk=5, init=0, local=1), [0, 1, 2, 3, 4])
        # a forced block keeps its place whatever its score
        self.assertEqual(sel_row([np.nan, 5, 1, 0, np.nan], 20, topk=2, init=1, local=1), [0, 4])

    def test_vectorised_matches_rows(self):
        rng = np.random.default_rng(3)
        scores = rng.integers(-3, 3, (2, 50, 9)).astype(F32)  # many ties
        scores[0, :5] = np.nan
        kv = rng.integers(1, 9 * 8 + 1, 50)
        nblocks = -(-kv // 8)
        sel = R.select_blocks(scores, nblocks[None, :], 4, 1, 1)
        for g in range(2):
            for r in range(50):
                self.assertEqual(list(sel[g, r]), sel_row(scores[g, r], kv[r], bs=8, topk=4, init=1, local=1))
                chosen = sel[g, r][sel[g, r] >= 0]
                self.assertTrue(np.all(np.diff(chosen) > 0))
                self.assertEqual(len(chosen), min(4, nblocks[r]))

    def test_router_ties_and_weights(self):
        logits = np.zeros((1, 6), F32)
        ids, w = R.route(logits, None, 3)
        self.assertEqual(list(ids[0]), [0, 1, 2])          # all equal: lowest ids
        np.testing.assert_allclose(w, [[1 / 3] * 3], rtol=1e-6)
        bias = np.array([0, 0.5, 0, 0.5, 0, 1.0], F32)
        ids, _ = R.route(logits, bias, 2)
        self.assertEqual(list(ids[0]), [5, 1])             # 1 beats 3 at equal s + bias
        logits = np.array([[2.0, -1.0, 0.0, 1.0]], F32)
        bias = np.array([-10, 10, 0, 0], F32)              # bias selects, never weighs
        ids, w = R.route(logits, bias, 2)
        self.assertEqual(list(ids[0]), [1, 3])             # keys -9.1, 10.3, 0.5, 0.7
        s = 1 / (1 + np.exp(-np.array([-1.0, 1.0])))
        np.testing.assert_allclose(w[0], s / s.sum(), rtol=1e-6)
        ids, _ = R.route(np.array([[np.nan, 0.0, 1.0]], F32), None, 2)
        self.assertEqual(list(ids[0]), [2, 1])             # NaN never preferred


# --------------------------------------------------------------------------
# Sparse attention against a slow per-row loop
# --------------------------------------------------------------------------

def slow_sparse_attention(q, k, v, iq, ik, bs, topk, init, local):
    """Straightforward per row / per head transcription of SPEC 3 + 2.3 step 5
    with the reference's precision convention: every dot and sum is math.fsum
    of float64 products rounded once to fp32, exp is libm's double exp rounded
    once, the rest fp32.  Returns unrounded fp32 head outputs and selections."""
    T, nh, hd = q.shape
    G = k.shape[1]
    out = np.zeros((T, nh, hd), F32)
    sels = np.full((G, T, topk), -1, np.int64)
    c = F32(iq.shape[-1] ** -0.5 * math.log2(math.e))
    scale = F32(hd ** -0.5)

    def dot(a, b):
        return F32(math.fsum(np.asarray(a, F64) * np.asarray(b, F64)))

    for t in range(T):
        kv_len = t + 1
        nblocks = -(-kv_len // bs)
        for g in range(G):
            scores = []
            for b in range(nblocks):
                js = range(b * bs, min((b + 1) * bs, kv_len))
                scores.append(max(dot(iq[t, g], ik[j]) for j in js) * c)

            def rank(b):
                forced = b < init or b >= nblocks - local
                s = scores[b]
                return (forced, not math.isnan(s), -math.inf if math.isnan(s) else s, b)
            chosen = sorted(sorted(range(nblocks), key=rank, reverse=True)[:topk])
            sels[g, t, :len(chosen)] = chosen
            keys = [j for b in chosen for j in range(b * bs, min((b + 1) * bs, kv_len))]
            for h in range(g * (nh // G), (g + 1) * (nh // G)):
                s = np.array([dot(q[t, h], k[j, g]) for j in keys], F32) * scale
                e = np.array([math.exp(float(z)) for z in s - s.max()]).astype(F32)
                p = e / F32(math.fsum(e.astype(F64)))
                out[t, h] = [dot(p, v[keys, g, d]) for d in range(hd)]
    return out, sels


class SparseAttention(unittest.TestCase):
    def test_vectorised_equals_slow_loop(self):
        rng = np.random.default_rng(4)
        T, nh, G, hd, d, bs = 70, 4, 2, 8, 8, 8
        q, k, v = (R.bf16_round(rng.standard_normal(s).astype(F32)) for s in
                   ((T, nh, hd), (T, G, hd), (T, G, hd)))
        iq = R.bf16_round(rng.standard_normal((T, G, d)).astype(F32))
        ik = R.bf16_round(rng.standard_normal((T, d)).astype(F32))
        sp = dict(iq=iq, ik=ik, block_size=bs, topk=3, init_blocks=1, local_blocks=1)
        for chunk in (16, 64):  # several chunks per run, and one
            out, sels = R.attention(q, k, v, np.arange(T), sp, row_chunk=chunk)
            want, wsel = slow_sparse_attention(q, k, v, iq, ik, bs, 3, 1, 1)
            np.testing.assert_array_equal(sels, wsel)
            np.testing.assert_array_equal(out, R.bf16_round(want))  # bit for bit
        # Decode-like use: a few rows at the end over the full cache.
        rows = np.array([40, 69])
        sp_rows = dict(sp, iq=iq[rows])
        out_r, sel_r = R.attention(q[rows], k, v, rows, sp_rows)
        np.testing.assert_array_equal(sel_r, wsel[:, rows])
        np.testing.assert_array_equal(out_r, R.bf16_round(want[rows]))
        # The index scores themselves: f32(f64 dot), max over the visible
        # block, then one fp32 multiply.
        sc = R.index_block_scores(iq, ik, np.arange(T), bs)
        c = F32(d ** -0.5 * math.log2(math.e))
        for t in (0, 9, 37, 69):
            for g in range(G):
                for b in range(-(-(t + 1) // bs)):
                    js = range(b * bs, min((b + 1) * bs, t + 1))
                    m = max(F32(math.fsum(iq[t, g].astype(F64) * ik[j].astype(F64))) for j in js)
                    self.assertEqual(sc[g, t, b].tobytes(), (m * c).tobytes())
                self.assertTrue(np.all(sc[g, t, -(-(t + 1) // bs):] == -np.inf))

    def test_sparse_with_all_blocks_equals_dense(self):
        rng = np.random.default_rng(5)
        T, bs = 50, 8
        q = R.bf16_round(rng.standard_normal((T, 4, 8)).astype(F32))
        k, v = (R.bf16_round(rng.standard_normal((T, 2, 8)).astype(F32)) for _ in range(2))
        iq = R.bf16_round(rng.standard_normal((T, 2, 8)).astype(F32))
        ik = R.bf16_round(rng.standard_normal((T, 8)).astype(F32))
        dense, _ = R.attention(q, k, v, np.arange(T))
        sparse, sel = R.attention(q, k, v, np.arange(T),
                                  dict(iq=iq, ik=ik, block_size=bs, topk=7, init_blocks=0, local_blocks=1))
        np.testing.assert_array_equal(sparse, dense)
        self.assertEqual(int((sel[:, -1] >= 0).sum()), 2 * 7)


# --------------------------------------------------------------------------
# End to end on tiny checkpoints
# --------------------------------------------------------------------------

class EndToEnd(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.cfg = tiny_config()
        cls.w = tiny_weights(cls.cfg)
        cls.dir = os.path.join(cls.tmp.name, "base")
        write_model(cls.dir, cls.cfg, cls.w)
        rng = np.random.default_rng(6)
        cls.tokens = rng.integers(0, cls.cfg["vocab_size"], 150)  # 10 blocks of 16
        cls.base = logits_of(cls.dir, cls.tokens)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def sub(self, name):
        return os.path.join(self.tmp.name, name)

    def test_shapes_finite_deterministic(self):
        self.assertEqual(self.base.shape, (150, 97))
        self.assertEqual(self.base.dtype, F32)
        self.assertTrue(np.all(np.isfinite(self.base)))
        again = logits_of(self.dir, self.tokens)
        np.testing.assert_array_equal(again, self.base)
        tail = logits_of(self.dir, self.tokens, prompt_len=100)
        np.testing.assert_array_equal(tail, self.base[99:])

    def test_causality_prefix(self):
        for n in (1, 33, 64, 97):
            np.testing.assert_array_equal(logits_of(self.dir, self.tokens[:n]), self.base[:n],
                                          err_msg=f"prefix {n}")

    def test_trace_selection_rules(self):
        trace = {}
        logits_of(self.dir, self.tokens, trace=trace)
        for i in (1, 3):
            sel = trace[f"L{i}.select"]                    # [G, L, topk]
            self.assertEqual(sel.shape, (2, 150, 3))
            for t in (0, 15, 16, 40, 149):
                nb = t // 16 + 1
                for g in range(2):
                    row = [b for b in sel[g, t] if b >= 0]
                    self.assertEqual(len(row), min(3, nb))
                    self.assertIn(0, row)                  # init block forced
                    self.assertIn(nb - 1, row)             # local block forced
        self.assertNotIn("L0.select", trace)
        self.assertEqual(trace["L1.experts"].shape, (150, 2))
        # the sparse layers really restrict attention: rows past 3 blocks differ
        # from what dense attention over the same q/k/v gives
        dense, _ = R.attention(trace["L1.q"], trace["L1.k"], trace["L1.v"], np.arange(150))
        self.assertFalse(np.array_equal(dense[48:], trace["L1.attn_heads"][48:]))
        np.testing.assert_array_equal(dense[:48], trace["L1.attn_heads"][:48])

    def test_moe_against_per_token_loop(self):
        """Layer 1's MoE output against a per-token transcription of SPEC 2.3 step 7
        (float64 products, the spec's bf16 rounding points)."""
        m = R.load_model(self.dir)
        trace = {}
        R.forward_logits(m, self.tokens[:80], trace=trace)
        pre = "layers.1.block_sparse_moe."
        x = R.bf16_round(R.rms_norm(trace["L1.residual"], self.w["layers.1.post_attention_layernorm.weight"], 1e-6))
        np.testing.assert_array_equal(R.moe_block(m, 1, x), trace["L1.hidden"])

        def ffn(xt, g, u, d):
            gg = R.bf16_round(np.float32(xt @ g.T.astype(np.float64)))
            uu = R.bf16_round(np.float32(xt @ u.T.astype(np.float64)))
            gc, uc = np.minimum(gg, 7.0), np.clip(uu, -7.0, 7.0)
            act = R.bf16_round(np.float32(gc / (1 + np.exp(-1.702 * gc.astype(np.float64))) * (uc + 1)))
            return R.bf16_round(np.float32(act @ d.T.astype(np.float64)))

        wg, bias = self.w[pre + "gate.weight"], self.w[pre + "e_score_correction_bias"]
        want = np.zeros_like(x)
        for t in range(x.shape[0]):
            s = 1 / (1 + np.exp(-(x[t].astype(np.float64) @ wg.T.astype(np.float64))))
            chosen = sorted(range(len(s)), key=lambda e: (-(s[e] + bias[e]), e))[:2]
            self.assertEqual(list(trace["L1.experts"][t]), chosen)
            y = sum(s[e] / sum(s[c] for c in chosen) *
                    ffn(x[t], *(self.w[f"{pre}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2")))
                    for e in chosen)
            y = 2.0 * y + ffn(x[t], *(self.w[f"{pre}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")))
            want[t] = R.bf16_round(np.float32(y))
        err = np.linalg.norm(trace["L1.hidden"] - want) / np.linalg.norm(want)
        self.assertLess(err, 1e-3)

    def test_sparse_topk_covering_all_blocks_equals_dense(self):
        d_sparse, d_dense = self.sub("topk_all"), self.sub("all_dense")
        write_model(d_sparse, tiny_config(sparse={"sparse_topk_blocks": 10}), self.w)
        write_model(d_dense, tiny_config(sparse={"sparse_attention_freq": [0, 0, 0, 0]}), self.w)
        a = logits_of(d_sparse, self.tokens)
        b = logits_of(d_dense, self.tokens)
        np.testing.assert_array_equal(a, b)
        self.assertFalse(np.array_equal(a, self.base))     # while topk 3 does change the result
        np.testing.assert_array_equal(a[:48], self.base[:48])  # ... only once > 3 blocks are visible

    def test_layouts_load_alike(self):
        """Sharded + nested text_config + other prefix, and tied embeddings."""
        d = self.sub("sharded")
        write_model(d, self.cfg, self.w, prefix="model.language_model.", lm_head="lm_head.weight",
                    shards=3, nest=True)
        np.testing.assert_array_equal(logits_of(d, self.tokens[:40]), self.base[:40])
        d = self.sub("bare_prefix")
        write_model(d, self.cfg, self.w, prefix="model.", lm_head="lm_head.weight")
        np.testing.assert_array_equal(logits_of(d, self.tokens[:40]), self.base[:40])
        d = self.sub("tied")
        w = dict(self.w)
        w["LM_HEAD"] = w["embed_tokens.weight"]
        write_model(d, tiny_config(tie_word_embeddings=True), w, drop=("LM_HEAD",))
        tied = logits_of(d, self.tokens[:40])
        untied_dir = self.sub("tied_explicit")
        write_model(untied_dir, self.cfg, w)
        np.testing.assert_array_equal(tied, logits_of(untied_dir, self.tokens[:40]))

    def test_config_and_name_spellings(self):
        """rotary_dim instead of partial_rotary_factor, sparse settings flattened
        to the top level, index tensors spelled self_attn.indexer.*."""
        d = self.sub("spellings")
        cfg = tiny_config(rotary_dim=8)
        del cfg["partial_rotary_factor"]
        cfg.update(cfg.pop("sparse_attention_config"))
        w = {s.replace("self_attn.index_", "self_attn.indexer."): a for s, a in self.w.items()}
        write_model(d, cfg, w)
        m = R.load_model(d)
        self.assertEqual((m.cfg.rotary_dim, m.cfg.topk_blocks, m.cfg.sparse), (8, 3, [False, True, False, True]))
        np.testing.assert_array_equal(R.forward_logits(m, self.tokens[:70]), self.base[:70])

    def test_mxfp8_equals_bf16_of_same_values(self):
        rng = np.random.default_rng(7)
        w = dict(self.w)
        q8 = {}
        for suffix, arr in self.w.items():
            if arr.ndim != 2 or suffix in ("embed_tokens.weight", "LM_HEAD") or "gate.weight" in suffix \
                    and "block_sparse_moe" in suffix:
                continue
            n, kdim = arr.shape
            if kdim % 32:
                continue
            # e4m3 bytes with exponent field <= 8 (|v| < 4) and no NaN codes
            raw = (rng.integers(0, 2, arr.shape) << 7 | rng.integers(0, 9, arr.shape) << 3
                   | rng.integers(0, 8, arr.shape)).astype(np.uint8)
            scale = rng.integers(121, 125, (n, kdim // 32)).astype(np.uint8)
            q8[suffix] = (raw, scale)
            w[suffix] = R.dequant_mxfp8(raw, scale)
            np.testing.assert_array_equal(R.bf16_round(w[suffix]), w[suffix])  # exact in bf16
        self.assertGreater(len(q8), 20)
        d8, d16 = self.sub("mxfp8"), self.sub("mxfp8_as_bf16")
        write_model(d8, self.cfg, w, mxfp8=q8)
        write_model(d16, self.cfg, w)
        a = logits_of(d8, self.tokens[:60])
        np.testing.assert_array_equal(a, logits_of(d16, self.tokens[:60]))
        self.assertTrue(np.all(np.isfinite(a)))

    def test_no_routing_bias_no_shared(self):
        d = self.sub("nobias")
        cfg = tiny_config(use_routing_bias=False, n_shared_experts=0)
        drop = [s for s in self.w if "correction_bias" in s or "shared_experts" in s]
        write_model(d, cfg, self.w, drop=drop)
        a = logits_of(d, self.tokens[:40])
        self.assertTrue(np.all(np.isfinite(a)))
        self.assertFalse(np.array_equal(a, self.base[:40]))

    def run_cli(self, *args):
        return subprocess.run([sys.executable, os.path.join(HERE, "m3_ref.py"), *args],
                              capture_output=True, text=True)

    def test_cli(self):
        out = self.sub("cli.npy")
        toks = ",".join(str(t) for t in self.tokens[:50])
        r = self.run_cli("--model", self.dir, "--tokens", toks, "--prompt-len", "20", "--out", out, "--greedy")
        self.assertEqual(r.returncode, 0, r.stderr)
        got = np.load(out)
        self.assertEqual(got.shape, (31, 97))
        self.assertEqual(got.dtype, F32)
        np.testing.assert_array_equal(got, self.base[19:50])
        want = ",".join(str(int(t)) for t in np.argmax(self.base[19:50], axis=-1))
        self.assertEqual(r.stdout.strip(), want)
        # prompt covering every token: one row, the next-token distribution
        r = self.run_cli("--model", self.dir, "--tokens", toks, "--prompt-len", "50", "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout, "")
        np.testing.assert_array_equal(np.load(out), self.base[49:50])

    def test_greedy_ties_lowest(self):
        x = np.array([[1, 3, 3, 0], [np.nan, 0, 0, -1]], F32)
        self.assertEqual(list(R.greedy_tokens(x)), [1, 1])

    def test_cli_errors(self):
        out = self.sub("err.npy")

        def expect_error(d, needle, toks="1,2,3", plen="1"):
            r = self.run_cli("--model", d, "--tokens", toks, "--prompt-len", plen, "--out", out)
            self.assertEqual(r.returncode, 2, (needle, r.stdout, r.stderr))
            self.assertIn(needle, r.stderr)
            self.assertNotIn("Traceback", r.stderr)

        d = self.sub("missing")
        write_model(d, self.cfg, self.w, drop=("layers.1.block_sparse_moe.experts.4.w3.weight",))
        expect_error(d, "missing tensor language_model.model.layers.1.block_sparse_moe.experts.4.w3.weight")
        d = self.sub("badshape")
        write_model(d, self.cfg, self.w, override={
            "language_model.model.layers.2.self_attn.k_proj.weight": ("BF16", np.zeros((16, 64), F32))})
        expect_error(d, "layers.2.self_attn.k_proj.weight has shape [16, 64], expected [32, 64]")
        d = self.sub("baddtype")
        write_model(d, self.cfg, self.w, override={
            "language_model.model.norm.weight": ("F16", np.zeros(64, np.float16))})
        expect_error(d, "norm.weight has dtype F16")
        d = self.sub("noscale")
        write_model(d, self.cfg, self.w, override={
            "language_model.model.layers.0.mlp.up_proj.weight": ("F8_E4M3", np.zeros((48, 64), np.uint8))})
        expect_error(d, "has no language_model.model.layers.0.mlp.up_proj.weight_scale_inv")
        expect_error(self.dir, "outside the vocabulary", toks="1,2,97")
        expect_error(self.dir, "prompt length 4", plen="4")
        expect_error(self.sub("nowhere"), "config.json")
        d = self.sub("badcfg")
        write_model(d, tiny_config(sparse={"sparse_num_index_heads": 1}), self.w)
        expect_error(d, "sparse_num_index_heads")
        d = self.sub("truncated")
        write_model(d, self.cfg, self.w)
        path = os.path.join(d, "model.safetensors")
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
        expect_error(d, "outside the file")


class Speed(unittest.TestCase):
    def test_700_tokens_hidden_256_is_quick(self):
        import time
        cfg = tiny_config(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                          head_dim=32, vocab_size=1000, moe_layer_freq=[0, 1, 1], intermediate_size=128,
                          dense_intermediate_size=512, shared_intermediate_size=128, num_local_experts=8,
                          sparse={"sparse_attention_freq": [0, 1, 1], "sparse_block_size": 128,
                                  "sparse_topk_blocks": 4, "sparse_init_block": 0, "sparse_index_dim": 32})
        with tempfile.TemporaryDirectory() as d:
            write_model(d, cfg, tiny_weights(cfg, seed=9))
            toks = np.random.default_rng(8).integers(0, 1000, 700)
            t0 = time.time()
            out = logits_of(d, toks)
            dt = time.time() - t0
        self.assertEqual(out.shape, (700, 1000))
        self.assertTrue(np.all(np.isfinite(out)))
        self.assertLess(dt, 20.0)
        print(f"\n  [700 tokens, hidden 256, 3 layers: {dt:.2f} s]", file=sys.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
