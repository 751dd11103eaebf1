#!/usr/bin/env python3
"""Independent numpy reference of the DSpark drafter (docs/DSPARK.md).

Written from docs/DSPARK.md alone (never from the C engine's src/spec/), on top
of m3_ref.py, the project's numpy reference of the target model: it uses the
target's embedding, lm_head and forward (through m3_ref.forward_logits' `taps`
hook) and m3_ref's primitives (bf16_round, mm, rms_norm, RoPE, SwiGLU-OAI,
the correctly rounded exp), so every reduction follows m3_ref's convention
"float64 accumulate, round once to fp32" and the result agrees with any
implementation that rounds at the same points to float rounding (~1e-6).

Pieces:
  load_drafter(dir, target_model)   config.json + safetensors, validated
  target_taps(model, tokens, taps)  c_q for every position, [n, k*H]
  context_kv(drafter, taps)         every draft layer's K/V of the context
  draft_logits(model, drafter, taps, p, anchor)   base logits [B, V]
  draft_tokens(drafter, base_logits, anchor)      Markov head + greedy drafts

Command line:
    python3 dspark_ref.py --model T --draft D --tokens 1,2,3,... \
        --cycles '[{"pos": p, "anchor": a}, ...]' --out F.npy
--tokens is the target's token sequence (comma list or @FILE); the taps of
positions 0..p-1 come from its teacher-forced forward.  --cycles is JSON text,
or a file holding it (@FILE or a plain path).  Writes float32 [C, B, V], each
cycle's draft logits with the Markov bias, and prints the drafts as JSON
([[d_1..d_B], ...]) on stdout.  Exit status 2 with a message on a bad
checkpoint, config or argument.
"""

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import m3_ref as R  # noqa: E402
from m3_ref import F32, F64, RefError, bf16_round, mm, rms_norm  # noqa: E402

PREFIXES = ("language_model.model.dspark.", "model.dspark.", "dspark.", "")
# (release spelling, NeMo spelling) of each DSpark key.
KEYS = {
    "taps": ("dspark_target_layer_ids", "target_layer_ids"),
    "mask": ("dspark_noise_token_id", "mask_token_id"),
    "block": ("dspark_block_size", "block_size"),
    "rank": ("dspark_markov_rank", "markov_rank"),
    "head_type": ("dspark_markov_head_type", "markov_head_type"),
}
MAX_BLOCK = 15


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

class DraftConfig:
    """The drafter's settings, normalised from config.json."""


def _int(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise RefError(f"config: {what} must be an integer, got {value!r}")
    return int(value)


def parse_draft_config(raw, target):
    """A drafter config.json dict (flat or nested under text_config) against the
    target's m3_ref Config; raises RefError naming the field on anything wrong."""
    if not isinstance(raw, dict):
        raise RefError("draft config: not a JSON object")
    tc = raw.get("text_config", raw)
    if not isinstance(tc, dict):
        raise RefError("draft config: text_config is not a JSON object")

    def lookup(key):
        """(spelling, value) of a DSpark key; the text config first, then the top level."""
        found = []
        for spelling in KEYS[key]:
            for where in (tc, raw):
                if spelling in where:
                    found.append((spelling, where[spelling]))
                    break
        if len(found) == 2 and found[0][1] != found[1][1]:
            raise RefError(f"draft config: {found[0][0]} = {found[0][1]!r} and {found[1][0]} = "
                           f"{found[1][1]!r} disagree")
        return found[0] if found else (None, None)

    def need(key):
        name, value = lookup(key)
        if name is None:
            raise RefError(f"draft config: missing {KEYS[key][0]} (or {KEYS[key][1]})")
        return name, value

    def get(key, default):
        """A plain field of the drafter config; absent: the target's value."""
        return tc[key] if tc.get(key) is not None else default

    c = DraftConfig()
    # Sizes shared with the target.
    for key, want in (("hidden_size", target.hidden), ("vocab_size", target.vocab)):
        if key not in tc:
            raise RefError(f"draft config: missing {key}")
        got = _int(tc[key], key)
        if got != want:
            raise RefError(f"draft config: {key} = {got} differs from the target's {want}")
    c.hidden, c.vocab = target.hidden, target.vocab

    name, taps = need("taps")
    if not isinstance(taps, list) or not taps:
        raise RefError(f"draft config: {name} must be a non-empty list of target layer ids, got {taps!r}")
    c.taps = [_int(t, name) for t in taps]
    for t in c.taps:
        if not 0 <= t < target.n_layers:
            raise RefError(f"draft config: {name} holds layer {t}, outside the target's "
                           f"0..{target.n_layers - 1}")
    if len(set(c.taps)) != len(c.taps):
        raise RefError(f"draft config: {name} repeats a layer: {c.taps}")
    c.k = len(c.taps)

    name, mask = need("mask")
    c.mask_token = _int(mask, name)
    if not 0 <= c.mask_token < c.vocab:
        raise RefError(f"draft config: {name} = {c.mask_token} outside the vocabulary [0, {c.vocab})")
    name, block = need("block")
    c.block = _int(block, name)
    if not 1 <= c.block <= MAX_BLOCK:
        raise RefError(f"draft config: {name} = {c.block} must be in 1..{MAX_BLOCK}")
    name, rank = lookup("rank")
    c.rank = None if name is None else _int(rank, name)   # None: from the tensors
    if c.rank is not None and c.rank < 0:
        raise RefError(f"draft config: {name} = {c.rank} must be >= 0")
    name, head_type = lookup("head_type")
    if name is not None and head_type != "vanilla":
        raise RefError(f"draft config: {name} = {head_type!r} is not supported (only 'vanilla')")

    if "num_hidden_layers" not in tc:
        raise RefError("draft config: missing num_hidden_layers")
    c.n_layers = _int(tc["num_hidden_layers"], "num_hidden_layers")
    if c.n_layers < 1:
        raise RefError(f"draft config: num_hidden_layers = {c.n_layers} must be >= 1")

    # Attention geometry: as the target's fields (SPEC 2.1), the target's value when absent.
    c.n_heads = _int(get("num_attention_heads", target.n_heads), "num_attention_heads")
    c.n_kv = _int(get("num_key_value_heads", target.n_kv), "num_key_value_heads")
    if c.n_heads < 1 or c.n_kv < 1 or c.n_heads % c.n_kv:
        raise RefError(f"draft config: num_attention_heads {c.n_heads} must be a positive multiple of "
                       f"num_key_value_heads {c.n_kv}")
    c.head_dim = _int(get("head_dim", c.hidden // c.n_heads if "num_attention_heads" in tc
                          else target.head_dim), "head_dim")
    if tc.get("rotary_dim") is not None:
        c.rotary_dim = _int(tc["rotary_dim"], "rotary_dim")
    elif tc.get("partial_rotary_factor") is not None:
        c.rotary_dim = int(round(float(tc["partial_rotary_factor"]) * c.head_dim))
    else:
        c.rotary_dim = target.rotary_dim
    if c.head_dim < 1 or c.rotary_dim % 2 or not 0 < c.rotary_dim <= c.head_dim:
        raise RefError(f"draft config: rotary_dim {c.rotary_dim} must be even and in 1..head_dim "
                       f"{c.head_dim}")
    theta = tc.get("rope_theta")
    if theta is None and isinstance(tc.get("rope_parameters"), dict):
        theta = tc["rope_parameters"].get("rope_theta")
    c.rope_theta = float(target.rope_theta if theta is None else theta)
    scaling = tc.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise RefError(f"draft config: rope_scaling {scaling!r} is not supported (plain RoPE only)")
    c.eps = float(get("rms_norm_eps", target.eps))
    c.swiglu_alpha = float(get("swiglu_alpha", target.swiglu_alpha))
    c.swiglu_limit = float(get("swiglu_limit", target.swiglu_limit))

    # Window: all sliding_attention -> W; all full_attention or absent -> none.
    c.window = None
    types = tc.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != c.n_layers:
            raise RefError(f"draft config: layer_types must list {c.n_layers} entries, got {types!r}")
        kinds = set(types)
        if kinds == {"sliding_attention"}:
            if tc.get("sliding_window") is None:
                raise RefError("draft config: layer_types are sliding_attention but sliding_window is missing")
            c.window = _int(tc["sliding_window"], "sliding_window")
            if c.window < c.block:
                raise RefError(f"draft config: sliding_window = {c.window} is smaller than the block "
                               f"size {c.block}")
        elif kinds != {"full_attention"}:
            raise RefError(f"draft config: layer_types {types!r} mixes or names unknown attention "
                           f"kinds (all sliding_attention or all full_attention)")
    ffn = tc.get("dspark_ffn_hidden_size")
    c.ffn = None if ffn is None else _int(ffn, "dspark_ffn_hidden_size")
    if c.ffn is not None and c.ffn < 1:
        raise RefError(f"draft config: dspark_ffn_hidden_size = {c.ffn} must be >= 1")
    return c


# --------------------------------------------------------------------------
# Checkpoint
# --------------------------------------------------------------------------

class Drafter:
    """A loaded drafter: config, tensor names and (cached) float32 weights."""

    def __init__(self, draft_dir, target):
        cfg_path = os.path.join(draft_dir, "config.json")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise RefError(f"cannot read {cfg_path}: {e}") from e
        self.cfg = parse_draft_config(raw, target.cfg)
        self.ckpt = R.Checkpoint(draft_dir)
        for p in PREFIXES:
            if p + "fc.weight" in self.ckpt:
                self.prefix = p
                break
        else:
            if any("confidence" in n for n in self.ckpt.where):
                raise RefError("draft checkpoint holds only a confidence head (no fc.weight): "
                               "confidence-head-only drafts are not supported")
            raise RefError("draft checkpoint has no fc.weight under any of the prefixes "
                           + ", ".join(repr(p) for p in PREFIXES))
        self._weights = {}
        self.validate()

    def name(self, suffix):
        """Full tensor name for a suffix such as 'layers.0.self_attn.q_proj.weight'."""
        if suffix.startswith("layers."):
            i, rest = suffix[len("layers."):].split(".", 1)
            cands = (f"layers.{i}.decoder_layer.{rest}", suffix)
        elif suffix == "final_norm.weight":
            cands = ("final_norm.weight", "norm.weight")
        else:
            cands = (suffix,)
        for s in cands:
            if self.prefix + s in self.ckpt:
                return self.prefix + s
        return None

    def expected(self):
        """(suffix, shape, kind) of every tensor the drafter reads; kind 'norm' (bf16)
        or 'linear' (bf16 or MXFP8)."""
        c = self.cfg
        H, D = c.hidden, c.head_dim
        out = [("fc.weight", (H, c.k * H), "linear"), ("hidden_norm.weight", (H,), "norm"),
               ("final_norm.weight", (H,), "norm")]
        if c.rank:
            out += [("markov_head.markov_w1.weight", (c.vocab, c.rank), "norm"),
                    ("markov_head.markov_w2.weight", (c.vocab, c.rank), "norm")]
        for i in range(c.n_layers):
            L = f"layers.{i}."
            out += [(L + "input_layernorm.weight", (H,), "norm"),
                    (L + "post_attention_layernorm.weight", (H,), "norm"),
                    (L + "self_attn.q_proj.weight", (c.n_heads * D, H), "linear"),
                    (L + "self_attn.k_proj.weight", (c.n_kv * D, H), "linear"),
                    (L + "self_attn.v_proj.weight", (c.n_kv * D, H), "linear"),
                    (L + "self_attn.o_proj.weight", (H, c.n_heads * D), "linear"),
                    (L + "self_attn.q_norm.weight", (D,), "norm"),
                    (L + "self_attn.k_norm.weight", (D,), "norm"),
                    (L + "mlp.gate_proj.weight", (c.ffn, H), "linear"),
                    (L + "mlp.up_proj.weight", (c.ffn, H), "linear"),
                    (L + "mlp.down_proj.weight", (H, c.ffn), "linear")]
        return out

    def validate(self):
        c = self.cfg
        # Markov rank from the tensors when the config does not give it.
        w1 = self.name("markov_head.markov_w1.weight")
        if c.rank is None:
            c.rank = self.ckpt.info(w1)[1][-1] if w1 is not None and len(self.ckpt.info(w1)[1]) == 2 else 0
        if c.ffn is None:
            g = self.name("layers.0.mlp.gate_proj.weight")
            if g is None:
                raise RefError(f"missing tensor {self.prefix}layers.0.mlp.gate_proj.weight "
                               f"(needed for the MLP width)")
            c.ffn = int(self.ckpt.info(g)[1][0])
        problems = []
        for suffix, shape, kind in self.expected():
            full = self.name(suffix)
            if full is None:
                problems.append(f"missing tensor {self.prefix}{suffix}")
                continue
            dtype, got = self.ckpt.info(full)
            allowed = ("BF16", "F8_E4M3") if kind == "linear" else ("BF16",)
            if dtype not in allowed:
                problems.append(f"tensor {full} has dtype {dtype}, expected {' or '.join(allowed)}")
            elif tuple(got) != tuple(shape):
                problems.append(f"tensor {full} has shape {list(got)}, expected {list(shape)}")
            elif dtype == "F8_E4M3":
                sname = full + "_scale_inv"
                want = (shape[0], shape[1] // 32)
                if sname not in self.ckpt:
                    problems.append(f"MXFP8 tensor {full} has no {sname}")
                elif shape[1] % 32 or self.ckpt.info(sname) != ("U8", want):
                    sd, ss = self.ckpt.info(sname)
                    problems.append(f"MXFP8 scale {sname} is {sd} {list(ss)}, expected U8 {list(want)}")
        if problems:
            more = f" (and {len(problems) - 12} more)" if len(problems) > 12 else ""
            raise RefError("bad draft checkpoint: " + "; ".join(problems[:12]) + more)

    def w(self, suffix):
        """float32 copy of a tensor (MXFP8 dequantised), cached (drafters are small)."""
        if suffix not in self._weights:
            full = self.name(suffix)
            if full is None:
                raise RefError(f"missing tensor {self.prefix}{suffix}")
            dtype, _ = self.ckpt.info(full)
            raw = self.ckpt.raw(full)
            if dtype == "BF16":
                t = R.bf16_bits_to_f32(raw)
            elif dtype == "F8_E4M3":
                t = R.dequant_mxfp8(raw, self.ckpt.raw(full + "_scale_inv"))
            else:
                raise RefError(f"tensor {full} has unsupported dtype {dtype}")
            self._weights[suffix] = t
        return self._weights[suffix]


def load_drafter(draft_dir, target_model):
    """Parse and validate a drafter folder against a loaded m3_ref target model."""
    return Drafter(draft_dir, target_model)


# --------------------------------------------------------------------------
# Math (docs/DSPARK.md "The math, with its rounding points")
# --------------------------------------------------------------------------

def target_taps(model, tokens, taps):
    """c_q for every position q of the teacher-forced target run over `tokens`:
    the taps bf16(hidden_L + residual_L) after each layer L in `taps` (in that
    order) concatenated, float32 [n, k*H] holding bf16 values."""
    taps = [int(t) for t in taps]
    for t in taps:
        if not 0 <= t < model.cfg.n_layers:
            raise RefError(f"tap layer {t} outside the target's 0..{model.cfg.n_layers - 1}")
    got = {t: None for t in taps}
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    R.forward_logits(model, tokens, prompt_len=max(1, tokens.shape[0]), taps=got)
    return np.concatenate([got[t] for t in taps], axis=1)


def _heads_norm_rope(x, n, d, w, eps, cos, sin, rotary_dim):
    """[T, n*d] projection -> per-head Gemma norm, RoPE, one bf16 rounding."""
    t = x.reshape(x.shape[0], n, d)
    return bf16_round(R.apply_rope(rms_norm(t, w, eps), cos, sin, rotary_dim))


def context_kv(drafter, taps):
    """Every draft layer's cached K/V of context positions 0..n-1 from taps [n, k*H]:
    a list of (k [n, G, D], v [n, G, D]), bf16-valued.  Row q depends on taps[q]
    only, so slicing [0:p] equals computing from taps[0:p] (bit for bit)."""
    c = drafter.cfg
    taps = np.asarray(taps, dtype=F32)
    if taps.ndim != 2 or taps.shape[1] != c.k * c.hidden:
        raise RefError(f"taps have shape {list(taps.shape)}, expected [n, {c.k * c.hidden}]")
    n = taps.shape[0]
    u = bf16_round(mm(taps, drafter.w("fc.weight")))
    h = bf16_round(rms_norm(u, drafter.w("hidden_norm.weight"), c.eps))
    cos, sin = R.rope_cos_sin(np.arange(n), c.rotary_dim, c.rope_theta)
    out = []
    for i in range(c.n_layers):
        A = f"layers.{i}.self_attn."
        k = bf16_round(mm(h, drafter.w(A + "k_proj.weight")))
        v = bf16_round(mm(h, drafter.w(A + "v_proj.weight"))).reshape(n, c.n_kv, c.head_dim)
        k = _heads_norm_rope(k, c.n_kv, c.head_dim, drafter.w(A + "k_norm.weight"), c.eps,
                             cos, sin, c.rotary_dim)
        out.append((k, v))
    return out


def draft_attention(q, kc, vc, kb, vb, p, window=None):
    """Block rows q [B, nh, D] at positions p..p+B-1 over the context keys kc, vc
    [p, G, D] (position q' = index) and the block's keys kb, vb [B, G, D].

    Row j sees context q' <= p-1 (and q' >= p+j-W+1 with a window W) and every
    block row (non-causal).  m3_ref's convention 3: s = f32(dot_f64) * f32(D^-0.5),
    fp32 softmax with the correctly rounded exp, sums in float64 rounded once;
    each head's output rounded to bf16."""
    B, nh, D = q.shape
    G = kb.shape[1]
    hpg = nh // G
    start = 0 if window is None else max(0, p - window + 1)   # nothing before it is visible
    kc, vc = kc[start:p], vc[start:p]
    cpos = np.arange(start, p)
    rpos = p + np.arange(B)
    ctx_ok = np.ones((B, cpos.shape[0]), dtype=bool)
    if window is not None:
        ctx_ok &= cpos[None, :] >= rpos[:, None] - window + 1
    allowed = np.concatenate([ctx_ok, np.ones((B, B), dtype=bool)], axis=1)
    k = np.concatenate([kc, kb], axis=0)
    v = np.concatenate([vc, vb], axis=0)
    scale = F32(D ** -0.5)
    out = np.empty((B, nh, D), dtype=F32)
    for g in range(G):
        qg = q[:, g * hpg:(g + 1) * hpg].transpose(1, 0, 2).astype(F64)      # [hpg, B, D]
        s = np.matmul(qg, k[:, g].T.astype(F64)).astype(F32) * scale        # [hpg, B, keys]
        s = np.where(allowed[None], s, F32(-np.inf))
        e = R.exp_f32(s - s.max(axis=-1, keepdims=True))
        tot = e.sum(axis=-1, keepdims=True, dtype=F64).astype(F32)
        o = np.matmul((e / tot).astype(F64), v[:, g].astype(F64)).astype(F32)
        out[:, g * hpg:(g + 1) * hpg] = o.transpose(1, 0, 2)
    return bf16_round(out)


def draft_forward(model, drafter, ctx, p, row_tokens):
    """Base logits [B, V] (fp32) of block rows holding row_tokens at positions
    p..p+B-1, over context positions 0..p-1 of ctx (context_kv's output)."""
    c = drafter.cfg
    row_tokens = np.asarray(row_tokens, dtype=np.int64)
    B = row_tokens.shape[0]
    if np.any((row_tokens < 0) | (row_tokens >= c.vocab)):
        raise RefError(f"draft row tokens {row_tokens.tolist()} outside the vocabulary [0, {c.vocab})")
    if ctx and not 0 <= p <= ctx[0][0].shape[0]:
        raise RefError(f"draft position {p} needs taps of positions 0..{p - 1}, "
                       f"have {ctx[0][0].shape[0]}")
    pos = p + np.arange(B)
    cos, sin = R.rope_cos_sin(pos, c.rotary_dim, c.rope_theta)
    residual = bf16_round(model.embed_rows(row_tokens))
    hidden = None
    for i in range(c.n_layers):
        L = f"layers.{i}."
        A = L + "self_attn."
        if hidden is not None:
            residual = bf16_round(hidden + residual)
        x = bf16_round(rms_norm(residual, drafter.w(L + "input_layernorm.weight"), c.eps))
        q = bf16_round(mm(x, drafter.w(A + "q_proj.weight")))
        k = bf16_round(mm(x, drafter.w(A + "k_proj.weight")))
        v = bf16_round(mm(x, drafter.w(A + "v_proj.weight"))).reshape(B, c.n_kv, c.head_dim)
        q = _heads_norm_rope(q, c.n_heads, c.head_dim, drafter.w(A + "q_norm.weight"), c.eps,
                             cos, sin, c.rotary_dim)
        k = _heads_norm_rope(k, c.n_kv, c.head_dim, drafter.w(A + "k_norm.weight"), c.eps,
                             cos, sin, c.rotary_dim)
        kc, vc = ctx[i]
        o = draft_attention(q, kc, vc, k, v, p, c.window)
        o = bf16_round(mm(o.reshape(B, c.n_heads * c.head_dim), drafter.w(A + "o_proj.weight")))
        residual = bf16_round(residual + o)
        x = bf16_round(rms_norm(residual, drafter.w(L + "post_attention_layernorm.weight"), c.eps))
        M = L + "mlp."
        hidden = R.swiglu_ffn(x, drafter.w(M + "gate_proj.weight"), drafter.w(M + "up_proj.weight"),
                              drafter.w(M + "down_proj.weight"), c.swiglu_alpha, c.swiglu_limit)
    final = bf16_round(rms_norm(bf16_round(hidden + residual), drafter.w("final_norm.weight"), c.eps))
    return model.logits(final)


def block_tokens(drafter, anchor):
    """Row 0 the anchor, rows 1..B-1 the mask token."""
    return np.array([int(anchor)] + [drafter.cfg.mask_token] * (drafter.cfg.block - 1), dtype=np.int64)


def draft_logits(model, drafter, taps, p, anchor, ctx=None):
    """The B rows' base logits (fp32, before the Markov bias) for anchor token
    `anchor` at position p, context positions 0..p-1 (taps[0:p]).  ctx: a
    precomputed context_kv(drafter, taps) (any rows past p are ignored)."""
    p = int(p)
    if ctx is None:
        taps = np.asarray(taps, dtype=F32)
        if not 0 <= p <= taps.shape[0]:
            raise RefError(f"draft position {p} needs taps of positions 0..{p - 1}, have {taps.shape[0]}")
        ctx = context_kv(drafter, taps[:p])
    return draft_forward(model, drafter, ctx, p, block_tokens(drafter, anchor))


def markov_bias(drafter, prev):
    """W2 . W1[prev]: fp32 [V] (float64 accumulate, one rounding)."""
    w1 = drafter.w("markov_head.markov_w1.weight")
    return mm(w1[int(prev)][None, :], drafter.w("markov_head.markov_w2.weight"))[0]


def draft_tokens(drafter, base_logits, anchor):
    """Vanilla Markov head applied row by row: row j gets l_j + W2 . W1[prev_j]
    with prev_0 = anchor and prev_j = d_j, and d_{j+1} is its argmax (lowest id
    on ties, NaN never wins).  Returns (logits_with_bias [B, V] fp32, drafts [B])."""
    base = np.asarray(base_logits, dtype=F32)
    out = base.copy()
    drafts = []
    prev = int(anchor)
    for j in range(base.shape[0]):
        if drafter.cfg.rank:
            out[j] = base[j] + markov_bias(drafter, prev)
        prev = int(R.greedy_tokens(out[j:j + 1])[0])
        drafts.append(prev)
    return out, np.array(drafts, dtype=np.int64)


def run_cycles(model, drafter, tokens, cycles):
    """(logits [C, B, V], drafts [C, B]) for cycles [(pos, anchor), ...], the taps
    from the teacher-forced target over `tokens`."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if not cycles:
        raise RefError("no cycles given")
    need = max(p for p, _ in cycles)
    for p, a in cycles:
        if p < 1 or p > tokens.shape[0]:
            raise RefError(f"cycle position {p} must be in 1..{tokens.shape[0]} (the number of tokens)")
        if not 0 <= a < model.cfg.vocab:
            raise RefError(f"cycle anchor {a} outside the vocabulary [0, {model.cfg.vocab})")
    taps = target_taps(model, tokens[:need], drafter.cfg.taps)
    ctx = context_kv(drafter, taps)
    logits, drafts = [], []
    for p, a in cycles:
        lg, d = draft_tokens(drafter, draft_logits(model, drafter, taps, p, a, ctx=ctx), a)
        logits.append(lg)
        drafts.append(d)
    return np.stack(logits).astype(F32), np.stack(drafts)


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------

def _parse_cycles(text):
    if not text.lstrip().startswith("["):
        path = text[1:] if text.startswith("@") else text
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise RefError(f"cannot read cycles file {path}: {e}") from e
    try:
        items = json.loads(text)
        cycles = [(int(c["pos"]), int(c["anchor"])) for c in items]
    except (ValueError, TypeError, KeyError) as e:
        raise RefError(f"--cycles must be a JSON list of {{\"pos\": p, \"anchor\": a}}: {e}") from e
    return cycles


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="target checkpoint folder")
    ap.add_argument("--draft", required=True, help="drafter checkpoint folder")
    ap.add_argument("--tokens", required=True, help="target tokens, comma-separated or @FILE")
    ap.add_argument("--cycles", required=True, help='JSON [{"pos": p, "anchor": a}, ...], or a file of it')
    ap.add_argument("--out", required=True, help="output .npy, float32 [C, B, V]")
    args = ap.parse_args(argv)
    try:
        tokens = R._parse_tokens(args.tokens)
        cycles = _parse_cycles(args.cycles)
        model = R.load_model(args.model)
        drafter = load_drafter(args.draft, model)
        logits, drafts = run_cycles(model, drafter, tokens, cycles)
        np.save(args.out, logits)
    except (RefError, OSError) as e:
        print(f"dspark_ref: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(drafts.tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
