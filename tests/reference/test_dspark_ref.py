#!/usr/bin/env python3
"""Self-checks of the numpy DSpark drafter reference (dspark_ref.py), no C engine needed.

Writes tiny drafter checkpoints with numpy (the safetensors writer and the
tiny target model of test_m3_ref.py) and checks the rules of docs/DSPARK.md
that are easy to get subtly wrong: the taps are the layer outputs; the block
attention against a slow per-row loop (context mask, window, non-causal
block); with W2 = 0 (or no head) the drafts are the base logits' argmax; the
Markov bias uses the previous row's draft (a head built to force a token chain
reproduces it); the block rows see each other (row 0 changes with the mask
token); a sliding window hides exactly the context keys outside it; only taps
0..p-1 matter; every accepted config spelling, tensor prefix and layout loads
to the same drafter; bad configs and checkpoints raise RefError naming the
field; the command line writes what it promises.

Run: python3 tests/reference/test_dspark_ref.py   (exit status non-zero on failure)
"""

import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dspark_ref as D  # noqa: E402
import m3_ref as R  # noqa: E402
import test_m3_ref as T  # noqa: E402  (its writer and tiny target; its tests stay in its module)

F32 = np.float32
F64 = np.float64
NEMO = {rel: nemo for rel, nemo in D.KEYS.values()}   # release -> NeMo spelling


# --------------------------------------------------------------------------
# Drafter checkpoints (test side)
# --------------------------------------------------------------------------

def draft_config(**over):
    cfg = {"model_type": "minimax_m3_dspark", "hidden_size": 64, "vocab_size": 97,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rotary_dim": 8, "rope_theta": 50000.0, "rms_norm_eps": 1e-6,
           "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
           "dspark_target_layer_ids": [0, 2, 3], "dspark_noise_token_id": 96,
           "dspark_block_size": 5, "dspark_markov_rank": 8, "dspark_markov_head_type": "vanilla",
           "dspark_ffn_hidden_size": 64}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def draft_weights(cfg, seed=0):
    """Generic suffix -> bf16-valued float32 array."""
    rng = np.random.default_rng(seed)
    H, V, nh, G, hd = (cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim"))
    k, F, r = len(cfg["dspark_target_layer_ids"]), cfg["dspark_ffn_hidden_size"], cfg["dspark_markov_rank"]

    def lin(n, m):
        return R.bf16_round(rng.standard_normal((n, m)).astype(F32) / np.sqrt(m))

    def nrm(n):
        return R.bf16_round(0.2 * rng.standard_normal(n).astype(F32))

    w = {"fc.weight": lin(H, k * H), "hidden_norm.weight": nrm(H), "final_norm.weight": nrm(H)}
    if r:
        w["markov_head.markov_w1.weight"] = R.bf16_round(0.5 * rng.standard_normal((V, r)).astype(F32))
        w["markov_head.markov_w2.weight"] = R.bf16_round(0.5 * rng.standard_normal((V, r)).astype(F32))
    for i in range(cfg["num_hidden_layers"]):
        L = f"layers.{i}."
        w.update({L + "input_layernorm.weight": nrm(H), L + "post_attention_layernorm.weight": nrm(H),
                  L + "self_attn.q_proj.weight": lin(nh * hd, H), L + "self_attn.k_proj.weight": lin(G * hd, H),
                  L + "self_attn.v_proj.weight": lin(G * hd, H), L + "self_attn.o_proj.weight": lin(H, nh * hd),
                  L + "self_attn.q_norm.weight": nrm(hd), L + "self_attn.k_norm.weight": nrm(hd),
                  L + "mlp.gate_proj.weight": lin(F, H), L + "mlp.up_proj.weight": lin(F, H),
                  L + "mlp.down_proj.weight": lin(H, F)})
    return w


def write_drafter(d, cfg, w, prefix="model.dspark.", decoder_layer=True, final="final_norm",
                  nemo=False, nest=False, shards=1, mxfp8=None, drop=(), extra=None):
    """config.json (release or NeMo spelling, flat or nested) and the tensors."""
    os.makedirs(d, exist_ok=True)
    c = {NEMO.get(k, k) if nemo else k: v for k, v in cfg.items()}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "dspark", "text_config": c} if nest else c, f)
    tensors = {}
    for suffix, arr in w.items():
        if suffix in drop:
            continue
        name = suffix
        if suffix.startswith("layers.") and decoder_layer:
            i, rest = suffix[len("layers."):].split(".", 1)
            name = f"layers.{i}.decoder_layer.{rest}"
        if suffix == "final_norm.weight":
            name = final + ".weight"
        if mxfp8 and suffix in mxfp8:
            tensors[prefix + name] = ("F8_E4M3", mxfp8[suffix][0])
            tensors[prefix + name + "_scale_inv"] = ("U8", mxfp8[suffix][1])
        else:
            tensors[prefix + name] = ("BF16", arr)
    tensors["confidence_head.weight"] = ("BF16", np.zeros((1, cfg["hidden_size"]), F32))  # ignored
    tensors.update(extra or {})
    names = list(tensors)
    if shards == 1:
        T.write_safetensors(os.path.join(d, "model.safetensors"), tensors)
        return d
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        T.write_safetensors(os.path.join(d, fname), part)
        weight_map.update({n: fname for n in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return d


# --------------------------------------------------------------------------
# Block attention against a slow per-row loop
# --------------------------------------------------------------------------

def slow_draft_attention(q, kc, vc, kb, vb, p, window):
    """Per row / per head transcription of the DSPARK.md key set with math.fsum
    sums of float64 products, each rounded once to fp32; unrounded heads."""
    B, nh, hd = q.shape
    G = kb.shape[1]
    scale = F32(hd ** -0.5)
    out = np.zeros((B, nh, hd), F32)

    def dot(a, b):
        return F32(math.fsum(np.asarray(a, F64) * np.asarray(b, F64)))

    for j in range(B):
        ctx = [c for c in range(p) if window is None or c >= p + j - window + 1]
        for h in range(nh):
            g = h // (nh // G)
            keys = [kc[c, g] for c in ctx] + [kb[i, g] for i in range(B)]
            vals = np.array([vc[c, g] for c in ctx] + [vb[i, g] for i in range(B)])
            s = np.array([dot(q[j, h], kk) for kk in keys], F32) * scale
            e = np.array([math.exp(float(z)) for z in s - s.max()]).astype(F32)
            pr = e / F32(math.fsum(e.astype(F64)))
            out[j, h] = [dot(pr, vals[:, d]) for d in range(hd)]
    return out


def slow_draft_logits(model, w, cfg, taps, p, anchor, window=None):
    """The whole draft step written out again position by position and row by
    row from DSPARK.md, each rounding point spelled out: base logits [B, V]."""
    eps, theta, rot = cfg["rms_norm_eps"], cfg["rope_theta"], cfg["rotary_dim"]
    nh, G, hd, B = (cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                     "dspark_block_size"))
    bf = R.bf16_round

    def lin(x, name):
        return bf(R.mm(x[None], w[name])[0])

    def norm(x, name):
        return bf(R.rms_norm(x, w[name], eps))

    def heads(x, n, name, pos):                 # per-head norm, RoPE at pos, one rounding
        cos, sin = R.rope_cos_sin([pos], rot, theta)
        return bf(R.apply_rope(R.rms_norm(x.reshape(1, n, hd), w[name], eps), cos, sin, rot))[0]

    layers = range(cfg["num_hidden_layers"])
    K = [np.zeros((p, G, hd), F32) for _ in layers]
    V = [np.zeros((p, G, hd), F32) for _ in layers]
    for q in range(p):
        h = norm(lin(taps[q], "fc.weight"), "hidden_norm.weight")
        for i in layers:
            K[i][q] = heads(lin(h, f"layers.{i}.self_attn.k_proj.weight"), G, f"layers.{i}.self_attn.k_norm.weight", q)
            V[i][q] = lin(h, f"layers.{i}.self_attn.v_proj.weight").reshape(G, hd)
    rows = [anchor] + [cfg["dspark_noise_token_id"]] * (B - 1)
    res = [bf(model.embed_rows([t])[0]) for t in rows]
    hid = None
    for i in layers:
        A = f"layers.{i}.self_attn."
        if hid is not None:
            res = [bf(h + r) for h, r in zip(hid, res)]
        x = [norm(r, f"layers.{i}.input_layernorm.weight") for r in res]
        qs = np.array([heads(lin(x[j], A + "q_proj.weight"), nh, A + "q_norm.weight", p + j) for j in range(B)])
        ks = np.array([heads(lin(x[j], A + "k_proj.weight"), G, A + "k_norm.weight", p + j) for j in range(B)])
        vs = np.array([lin(x[j], A + "v_proj.weight").reshape(G, hd) for j in range(B)])
        o = bf(slow_draft_attention(qs, K[i], V[i], ks, vs, p, window))
        res = [bf(r + lin(o[j].reshape(-1), A + "o_proj.weight")) for j, r in enumerate(res)]
        x = [norm(r, f"layers.{i}.post_attention_layernorm.weight") for r in res]
        M = f"layers.{i}.mlp."
        hid = []
        for xj in x:
            act = bf(R.swiglu_oai(lin(xj, M + "gate_proj.weight"), lin(xj, M + "up_proj.weight"),
                                  cfg["swiglu_alpha"], cfg["swiglu_limit"]))
            hid.append(lin(act, M + "down_proj.weight"))
    final = np.array([norm(bf(h + r), "final_norm.weight") for h, r in zip(hid, res)])
    return model.logits(final)


class Attention(unittest.TestCase):
    def test_matches_slow_loop(self):
        rng = np.random.default_rng(3)
        B, nh, G, hd = 5, 6, 2, 8
        for p, window in ((0, None), (1, None), (23, None), (3, 8), (4, 8), (23, 8), (23, 5)):
            q, kb, vb = (R.bf16_round(rng.standard_normal(s).astype(F32)) for s in
                         ((B, nh, hd), (B, G, hd), (B, G, hd)))
            kc, vc = (R.bf16_round(2 * rng.standard_normal((p, G, hd)).astype(F32)) for _ in range(2))
            got = D.draft_attention(q, kc, vc, kb, vb, p, window)
            want = slow_draft_attention(q, kc, vc, kb, vb, p, window)
            np.testing.assert_array_equal(got, R.bf16_round(want), err_msg=f"p={p} W={window}")


# --------------------------------------------------------------------------
# Whole drafter on a tiny target
# --------------------------------------------------------------------------

class Drafter(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.target_dir = os.path.join(cls.tmp.name, "target")
        T.write_model(cls.target_dir, T.tiny_config(), T.tiny_weights(T.tiny_config()))
        cls.model = R.load_model(cls.target_dir)
        cls.cfg = draft_config()
        cls.w = draft_weights(cls.cfg, seed=1)
        cls.dir = write_drafter(cls.sub("base"), cls.cfg, cls.w)
        cls.drafter = D.load_drafter(cls.dir, cls.model)
        cls.tokens = np.random.default_rng(5).integers(0, 96, 40)
        cls.taps = D.target_taps(cls.model, cls.tokens, cls.drafter.cfg.taps)
        cls.p, cls.a = 30, int(cls.tokens[30])
        cls.base = D.draft_logits(cls.model, cls.drafter, cls.taps, cls.p, cls.a)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def sub(cls, name):
        return os.path.join(cls.tmp.name, name)

    def logits_of(self, d, p=None, taps=None, anchor=None):
        dr = D.load_drafter(d, self.model)
        p = self.p if p is None else p
        taps = self.taps if taps is None else taps
        base = D.draft_logits(self.model, dr, taps, p, self.a if anchor is None else anchor)
        return base, dr

    def test_matches_slow_transcription(self):
        np.testing.assert_array_equal(
            slow_draft_logits(self.model, self.w, self.cfg, self.taps, self.p, self.a), self.base)
        d = write_drafter(self.sub("window8_slow"), draft_config(layer_types=["sliding_attention"] * 2,
                                                                  sliding_window=8), self.w)
        for p in (1, 13):
            a = int(self.tokens[p])
            np.testing.assert_array_equal(
                slow_draft_logits(self.model, self.w, self.cfg, self.taps, p, a, window=8),
                self.logits_of(d, p=p, anchor=a)[0], err_msg=f"p={p}")

    def test_taps_are_layer_outputs(self):
        trace, taps = {}, {0: None, 2: None, 3: None}
        plain = R.forward_logits(self.model, self.tokens)
        with_taps = R.forward_logits(self.model, self.tokens, trace=trace, taps=taps)
        np.testing.assert_array_equal(plain, with_taps)             # the hook changes nothing
        H = 64
        for n, L in enumerate((0, 2, 3)):
            want = R.bf16_round(trace[f"L{L}.hidden"] + trace[f"L{L}.residual"])
            np.testing.assert_array_equal(self.taps[:, n * H:(n + 1) * H], want)
        # the last layer's tap is what the final norm reads
        final = R.bf16_round(R.rms_norm(self.taps[:, 2 * H:], self.model.w("norm.weight"), 1e-6))
        np.testing.assert_array_equal(final, trace["final_norm"])
        # the order of the config's list is kept; taps are causal
        swapped = D.target_taps(self.model, self.tokens[:17], [3, 0])
        np.testing.assert_array_equal(swapped[:, :H], self.taps[:17, 2 * H:])
        np.testing.assert_array_equal(swapped[:, H:], self.taps[:17, :H])
        self.assertFalse(np.any(self.taps.view(np.uint32) & 0xFFFF))  # bf16 values

    def test_shapes_and_context(self):
        self.assertEqual(self.base.shape, (5, 97))
        self.assertEqual(self.base.dtype, F32)
        self.assertTrue(np.all(np.isfinite(self.base)))
        ctx = D.context_kv(self.drafter, self.taps)                # whole run, sliced inside
        np.testing.assert_array_equal(
            D.draft_logits(self.model, self.drafter, self.taps, self.p, self.a, ctx=ctx), self.base)
        future = self.taps.copy()
        future[self.p:] = R.bf16_round(future[self.p:] * F32(3) + F32(1))
        np.testing.assert_array_equal(self.logits_of(self.dir, taps=future)[0], self.base)
        last = self.taps.copy()
        last[self.p - 1] = R.bf16_round(-last[self.p - 1])
        changed = self.logits_of(self.dir, taps=last)[0]
        self.assertTrue(all(not np.array_equal(changed[j], self.base[j]) for j in range(5)))
        # the rows differ from each other (positions, tokens) and from another anchor
        self.assertFalse(np.array_equal(self.base[1], self.base[2]))
        other = self.logits_of(self.dir, anchor=(self.a + 1) % 96)[0]
        self.assertTrue(all(not np.array_equal(other[j], self.base[j]) for j in range(5)))

    def test_w2_zero_drafts_are_base_argmax(self):
        w = dict(self.w)
        w["markov_head.markov_w2.weight"] = np.zeros_like(w["markov_head.markov_w2.weight"])
        base, dr = self.logits_of(write_drafter(self.sub("w2zero"), self.cfg, w))
        np.testing.assert_array_equal(base, self.base)             # the head is not in the base
        out, drafts = D.draft_tokens(dr, base, self.a)
        np.testing.assert_array_equal(out, base)
        self.assertEqual(drafts.tolist(), np.argmax(base, axis=1).tolist())
        # rank 0: no head, no Markov tensors read
        cfg = draft_config(dspark_markov_rank=0)
        d = write_drafter(self.sub("rank0"), cfg, self.w,
                          drop=("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"))
        base0, dr0 = self.logits_of(d)
        np.testing.assert_array_equal(base0, self.base)
        self.assertEqual(D.draft_tokens(dr0, base0, self.a)[1].tolist(), np.argmax(base0, axis=1).tolist())
        # while the random head does move the drafts off the base argmax
        _, with_head = D.draft_tokens(self.drafter, self.base, self.a)
        self.assertNotEqual(with_head.tolist(), np.argmax(self.base, axis=1).tolist())

    def test_markov_bias_follows_previous_draft(self):
        out, drafts = D.draft_tokens(self.drafter, self.base, self.a)
        w1, w2 = self.w["markov_head.markov_w1.weight"], self.w["markov_head.markov_w2.weight"]
        prev = [self.a] + drafts[:-1].tolist()
        for j in range(5):
            bias = np.array([math.fsum(F64(w2[v, i]) * F64(w1[prev[j], i]) for i in range(8))
                             for v in range(97)]).astype(F32)
            np.testing.assert_array_equal(out[j], self.base[j] + bias, err_msg=f"row {j}")
            self.assertEqual(drafts[j], int(np.argmax(out[j])))

    def test_markov_head_forces_a_chain(self):
        others = [t for t in (7, 3, 88, 8, 41, 50, 60) if t != self.a]
        chain = [self.a] + others[:5]                             # anchor, then d_1..d_5
        w = dict(self.w)
        w1 = np.zeros((97, 8), F32)
        w2 = np.zeros((97, 8), F32)
        for i, (t, nxt) in enumerate(zip(chain, chain[1:])):
            w1[t, i] = 1.0
            w2[nxt, i] = 1024.0
        w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"] = w1, w2
        base, dr = self.logits_of(write_drafter(self.sub("chain"), self.cfg, w))
        out, drafts = D.draft_tokens(dr, base, self.a)
        self.assertEqual(drafts.tolist(), chain[1:])
        self.assertNotEqual(np.argmax(base, axis=1).tolist(), chain[1:])
        # ties go to the lowest id: row 0 gets the same bias on two tokens, flat base logits
        w2 = w2.copy()
        w2[others[-1], 0] = 1024.0                                # others[-1] > chain[1]
        w["markov_head.markov_w2.weight"] = w2
        _, dr = self.logits_of(write_drafter(self.sub("chain_tie"), self.cfg, w))
        flat = np.zeros_like(base)
        self.assertEqual(D.draft_tokens(dr, flat, self.a)[1][0], chain[1])
        flat[0, others[-1]] = 1.0                                 # the base logit breaks the tie
        self.assertEqual(D.draft_tokens(dr, flat, self.a)[1][0], others[-1])

    def test_block_rows_are_not_causal(self):
        ctx = D.context_kv(self.drafter, self.taps[:self.p])
        rows = D.block_tokens(self.drafter, self.a)
        self.assertEqual(rows.tolist(), [self.a] + [96] * 4)
        np.testing.assert_array_equal(D.draft_forward(self.model, self.drafter, ctx, self.p, rows), self.base)
        later = rows.copy()
        later[4] = 12                                     # only the last row's token differs
        changed = D.draft_forward(self.model, self.drafter, ctx, self.p, later)
        self.assertFalse(np.array_equal(changed[0], self.base[0]))   # row 0 sees row 4
        # the mask token comes from the config, in either spelling
        base, _ = self.logits_of(write_drafter(self.sub("mask50"), draft_config(dspark_noise_token_id=50),
                                               self.w))
        self.assertFalse(np.array_equal(base[0], self.base[0]))

    def test_sliding_window_hides_old_context(self):
        cfg = draft_config(layer_types=["sliding_attention"] * 2, sliding_window=8)
        d = write_drafter(self.sub("window8"), cfg, self.w)
        # every row's window covers the context while p + B - 1 - W + 1 <= 0, i.e. p <= W - B
        for p in (1, 3):
            win, _ = self.logits_of(d, p=p, anchor=int(self.tokens[p]))
            full, _ = self.logits_of(self.dir, p=p, anchor=int(self.tokens[p]))
            np.testing.assert_array_equal(win, full, err_msg=f"p={p}")
        win, _ = self.logits_of(d, p=4, anchor=int(self.tokens[4]))   # row 4 loses position 0
        full, _ = self.logits_of(self.dir, p=4, anchor=int(self.tokens[4]))
        self.assertFalse(np.array_equal(win, full))
        base_w, _ = self.logits_of(d)          # p = 30: row j sees context positions >= 23 + j
        old = self.taps.copy()
        old[:self.p - 8 + 1] = R.bf16_round(old[:self.p - 8 + 1] * F32(-2))   # positions 0..22
        np.testing.assert_array_equal(self.logits_of(d, taps=old)[0], base_w)
        edge = self.taps.copy()
        edge[self.p - 8 + 1] = R.bf16_round(-edge[self.p - 8 + 1])            # position 23: row 0 only
        self.assertFalse(np.array_equal(self.logits_of(d, taps=edge)[0][0], base_w[0]))
        # a full_attention list is no window
        d = write_drafter(self.sub("full_types"), draft_config(layer_types=["full_attention"] * 2,
                                                                sliding_window=8), self.w)
        np.testing.assert_array_equal(self.logits_of(d)[0], self.base)

    def test_layouts_and_spellings_load_alike(self):
        variants = {
            "nemo_nested": dict(nemo=True, nest=True),
            "nemo_flat": dict(nemo=True),
            "prefix_lm": dict(prefix="language_model.model.dspark."),
            "prefix_dspark": dict(prefix="dspark."),
            "prefix_none": dict(prefix=""),
            "plain_layers_norm": dict(decoder_layer=False, final="norm"),
            "sharded": dict(shards=3, nest=True),
        }
        for name, kw in variants.items():
            base, dr = self.logits_of(write_drafter(self.sub(name), self.cfg, self.w, **kw))
            np.testing.assert_array_equal(base, self.base, err_msg=name)
            self.assertEqual((dr.cfg.taps, dr.cfg.block, dr.cfg.rank, dr.cfg.mask_token, dr.cfg.window),
                             ([0, 2, 3], 5, 8, 96, None), name)
        # F and r read from the tensors when the config leaves them out
        base, dr = self.logits_of(write_drafter(self.sub("inferred"), draft_config(
            dspark_ffn_hidden_size=None, dspark_markov_rank=None), self.w))
        self.assertEqual((dr.cfg.ffn, dr.cfg.rank), (64, 8))
        np.testing.assert_array_equal(base, self.base)

    def test_mxfp8_equals_bf16_of_same_values(self):
        rng = np.random.default_rng(9)
        w, q8 = dict(self.w), {}
        for suffix, arr in self.w.items():
            if arr.ndim != 2 or "markov" in suffix:
                continue
            raw = (rng.integers(0, 2, arr.shape) << 7 | rng.integers(0, 9, arr.shape) << 3
                   | rng.integers(0, 8, arr.shape)).astype(np.uint8)
            scale = rng.integers(121, 125, (arr.shape[0], arr.shape[1] // 32)).astype(np.uint8)
            q8[suffix] = (raw, scale)
            w[suffix] = R.dequant_mxfp8(raw, scale)
        self.assertEqual(len(q8), 1 + 7 * 2)
        a, _ = self.logits_of(write_drafter(self.sub("mx"), self.cfg, w, mxfp8=q8))
        b, _ = self.logits_of(write_drafter(self.sub("mx_bf16"), self.cfg, w))
        np.testing.assert_array_equal(a, b)
        self.assertTrue(np.all(np.isfinite(a)))

    def test_bad_configs_raise(self):
        bad_cfg = [
            (dict(dspark_markov_head_type="gated"), "dspark_markov_head_type"),
            (dict(layer_types=["sliding_attention"] * 2, sliding_window=4), "sliding_window = 4"),
            (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8), "layer_types"),
            (dict(dspark_target_layer_ids=[0, 4]), "layer 4"),
            (dict(dspark_target_layer_ids=[2, 2]), "repeats"),
            (dict(dspark_target_layer_ids=[]), "dspark_target_layer_ids"),
            (dict(hidden_size=32), "hidden_size = 32"),
            (dict(vocab_size=98), "vocab_size = 98"),
            (dict(dspark_block_size=16), "dspark_block_size = 16"),
            (dict(dspark_block_size=0), "dspark_block_size = 0"),
            (dict(dspark_noise_token_id=97), "dspark_noise_token_id = 97"),
            (dict(dspark_noise_token_id=None), "missing dspark_noise_token_id"),
            (dict(dspark_ffn_hidden_size=96), "mlp.gate_proj.weight has shape [64, 64], expected [96, 64]"),
            (dict(dspark_markov_rank=4), "markov_w1.weight has shape [97, 8], expected [97, 4]"),
            (dict(num_key_value_heads=3), "num_key_value_heads"),
            (dict(mask_token_id=5), "disagree"),
        ]
        for n, (over, needle) in enumerate(bad_cfg):
            d = write_drafter(self.sub(f"bad{n}"), draft_config(**over), self.w)
            with self.assertRaises(R.RefError, msg=str(over)) as cm:
                D.load_drafter(d, self.model)
            self.assertIn(needle, str(cm.exception), str(over))
        # NeMo spelling named in its own words
        d = write_drafter(self.sub("bad_nemo"), draft_config(dspark_markov_head_type="gated"), self.w, nemo=True)
        with self.assertRaisesRegex(R.RefError, "markov_head_type = 'gated'"):
            D.load_drafter(d, self.model)
        bad_ckpt = [
            (dict(drop=("layers.1.mlp.down_proj.weight",)),
             "missing tensor model.dspark.layers.1.mlp.down_proj.weight"),
            (dict(drop=("markov_head.markov_w2.weight",)), "markov_w2"),
            (dict(extra={"model.dspark.layers.0.decoder_layer.self_attn.k_proj.weight":
                         ("F32", np.zeros((32, 64), F32))}), "has dtype F32"),
            (dict(prefix="model.draft."), "no fc.weight"),
            (dict(mxfp8={"fc.weight": (np.zeros((64, 192), np.uint8), np.zeros((64, 5), np.uint8))}),
             "MXFP8 scale"),
        ]
        for n, (kw, needle) in enumerate(bad_ckpt):
            d = write_drafter(self.sub(f"badck{n}"), self.cfg, self.w, **kw)
            with self.assertRaises(R.RefError, msg=needle) as cm:
                D.load_drafter(d, self.model)
            self.assertIn(needle, str(cm.exception))
        d = self.sub("confidence_only")
        write_drafter(d, self.cfg, {}, prefix="model.dspark.")
        with self.assertRaisesRegex(R.RefError, "confidence"):
            D.load_drafter(d, self.model)

    def run_cli(self, *args):
        return subprocess.run([sys.executable, os.path.join(HERE, "dspark_ref.py"), *args],
                              capture_output=True, text=True)

    def test_cli(self):
        out = self.sub("cli.npy")
        toks = ",".join(str(t) for t in self.tokens)
        cycles = [{"pos": self.p, "anchor": self.a}, {"pos": 12, "anchor": 77}, {"pos": 40, "anchor": 3}]
        r = self.run_cli("--model", self.target_dir, "--draft", self.dir, "--tokens", toks,
                         "--cycles", json.dumps(cycles), "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = np.load(out)
        self.assertEqual((got.shape, got.dtype), ((3, 5, 97), F32))
        drafts = json.loads(r.stdout)
        for n, c in enumerate(cycles):
            base = D.draft_logits(self.model, self.drafter, self.taps, c["pos"], c["anchor"])
            want, wd = D.draft_tokens(self.drafter, base, c["anchor"])
            np.testing.assert_array_equal(got[n], want)
            self.assertEqual(drafts[n], wd.tolist())
        path = self.sub("cycles.json")
        with open(path, "w") as f:
            json.dump(cycles[:1], f)
        r = self.run_cli("--model", self.target_dir, "--draft", self.dir, "--tokens", toks,
                         "--cycles", path, "--out", out)
        self.assertEqual(r.returncode, 0, r.stderr)
        np.testing.assert_array_equal(np.load(out), got[:1])
        for args, needle in (((self.dir, json.dumps([{"pos": 41, "anchor": 1}])), "cycle position 41"),
                             ((self.sub("nowhere"), json.dumps(cycles)), "config.json"),
                             ((self.dir, "[{\"pos\": 1}]"), "--cycles")):
            r = self.run_cli("--model", self.target_dir, "--draft", args[0], "--tokens", toks,
                             "--cycles", args[1], "--out", out)
            self.assertEqual(r.returncode, 2, (needle, r.stderr))
            self.assertIn(needle, r.stderr)
            self.assertNotIn("Traceback", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
