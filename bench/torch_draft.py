#!/usr/bin/env python3
"""PyTorch baseline for the DSpark draft step (SPEC §7 and §9, docs/DSPARK.md).

docs/PERF.md puts m3's draft step (`m3 generate --draft`'s draft_seconds per
step, gpu-check's `spec` stage) beside this script's: the same step on the
same weights written with ordinary PyTorch ops, for `reqs` requests of B
rows each (the anchor and B - 1 mask tokens at positions p..p+B-1, p =
context), over contiguous per-request context caches of `context`
positions (random O(1) bf16 keys and values; the block's own keys are
written behind them each step):

    embed -> per draft layer: [add +] Gemma RMSNorm -> q, k, v -> per-head
    norm + NeoX RoPE -> attention over [context (window) | block], no causal
    order inside the block (SDPA with GQA) -> o_proj -> add + post norm ->
    SwiGLU-OAI MLP -> final add + norm -> the target's lm_head (fp32 logits
    where torch offers a bf16 x bf16 -> fp32 product, else bf16) -> the
    Markov head row by row (W1's rows by the previous drafts, W2's product,
    argmax).

Modes: eager (plain calls) and graph (the step captured once in a
torch.cuda.CUDAGraph and replayed).

Bytes a step must read: every draft layer's weights, the lm_head, W2 once a
row (B times) and W1's rows, and each request's context keys and values in
every layer (the window's, when windowed). The floor is those bytes over the
streaming read bandwidth measured in the same run (a sum over a 2 GiB
tensor, best of 5).

Usage:
  python3 bench/torch_draft.py --target DIR --draft DIR [--reqs 1,2,4]
      [--context 1000] [--modes eager,graph] [--iters 20] [--json OUT]
  python3 bench/torch_draft.py --target DIR --draft DIR --check [--device cpu]

--check runs one step at a small context and compares each request's base
logits with tests/reference/dspark_ref.py's draft_forward on the same
context caches (relative L2 per row <= 2e-2: bf16 ops in another order) and
reports how many drafts agree; it exits 0 on pass.
"""

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
import dspark_ref as DR  # noqa: E402
import m3_ref as R  # noqa: E402

CHECK_BOUND = 2e-2


def bf16_tensor(raw, device):
    """A checkpoint tensor's raw bf16 bits as a torch bfloat16 tensor."""
    bits = np.array(raw, copy=True).view(np.int16)  # (the checkpoint is mapped read-only)
    return torch.from_numpy(bits).view(torch.bfloat16).to(device)


class Weights:
    """The drafter's tensors and the target's embedding and lm_head, bf16 on device."""

    def __init__(self, model, drafter, device):
        c = drafter.cfg
        self.c = c

        def dw(suffix):
            full = drafter.name(suffix)
            if full is None:
                raise SystemExit(f"the drafter has no tensor {suffix}")
            dtype, _ = drafter.ckpt.info(full)
            if dtype != "BF16":  # MXFP8: widened once (exact in bf16)
                return torch.from_numpy(drafter.w(suffix)).to(device, torch.bfloat16)
            return bf16_tensor(drafter.ckpt.raw(full), device)

        self.embed = bf16_tensor(model.ckpt.raw(model.prefix + "embed_tokens.weight"), device)
        self.lm_head = bf16_tensor(model.ckpt.raw(model.lm_head_name()), device)
        self.final_norm = dw("final_norm.weight")
        self.layers = []
        for i in range(c.n_layers):
            L, A, M = f"layers.{i}.", f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            names = {"in": L + "input_layernorm", "post": L + "post_attention_layernorm",
                     "q": A + "q_proj", "k": A + "k_proj", "v": A + "v_proj", "o": A + "o_proj",
                     "qn": A + "q_norm", "kn": A + "k_norm", "g": M + "gate_proj",
                     "u": M + "up_proj", "d": M + "down_proj"}
            self.layers.append({key: dw(name + ".weight") for key, name in names.items()})
        self.w1 = dw("markov_head.markov_w1.weight") if c.rank else None
        self.w2 = dw("markov_head.markov_w2.weight") if c.rank else None

    def layer_bytes(self):
        return sum(t.numel() * 2 for layer in self.layers for t in layer.values())


def rms(x, w, eps):
    """Gemma RMSNorm in fp32, one bf16 rounding."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv * (1.0 + w.float())).to(torch.bfloat16)


def rope(x, cos, sin, rotary_dim):
    """NeoX RoPE on x [T, heads, D] (fp32) over the first rotary_dim dims."""
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rotary_dim:]], dim=-1)


def head_norm_rope(x, heads, w, eps, cos, sin, rotary_dim):
    t = x.view(x.shape[0], heads, -1).float()
    inv = torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return rope(t * inv * (1.0 + w.float()), cos, sin, rotary_dim).to(torch.bfloat16)


_F32_OUT = {}


def matmul_f32(x, w):
    """x [T, K] bf16 times w [N, K]^T with fp32 out where torch has it (asked
    once per device, outside any graph capture: the first call is eager)."""
    dev = x.device.type
    if dev not in _F32_OUT:
        try:
            torch.mm(x[:1], w[:1].t(), out_dtype=torch.float32)
            _F32_OUT[dev] = True
        except (TypeError, RuntimeError):
            _F32_OUT[dev] = False
    if _F32_OUT[dev]:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return torch.mm(x, w.t()).float()


class DraftStep:
    """One draft step for `reqs` requests at position p = context, its inputs
    and caches allocated once (so a CUDA graph can capture it)."""

    def __init__(self, W, reqs, context, device, ctx_kv=None, seed=0):
        c = W.c
        self.W, self.c, self.reqs, self.p, self.B = W, c, reqs, context, c.block
        g = torch.Generator(device="cpu").manual_seed(seed)
        keys = context + self.B
        # per layer: K, V [reqs, Nkv, context + B, D]; the block's own keys go behind
        self.k, self.v = [], []
        for i in range(c.n_layers):
            if ctx_kv is not None:
                kc = torch.from_numpy(np.stack([r[i][0] for r in ctx_kv])).to(torch.bfloat16)
                vc = torch.from_numpy(np.stack([r[i][1] for r in ctx_kv])).to(torch.bfloat16)
            else:
                shape = (reqs, context, c.n_kv, c.head_dim)
                kc = (torch.rand(shape, generator=g) * 2 - 1).to(torch.bfloat16)
                vc = (torch.rand(shape, generator=g) * 2 - 1).to(torch.bfloat16)
            k = torch.zeros(reqs, c.n_kv, keys, c.head_dim, dtype=torch.bfloat16)
            v = torch.zeros_like(k)
            k[:, :, :context] = kc.transpose(1, 2)
            v[:, :, :context] = vc.transpose(1, 2)
            self.k.append(k.to(device))
            self.v.append(v.to(device))
        pos = context + np.arange(self.B)
        cos, sin = R.rope_cos_sin(pos, c.rotary_dim, c.rope_theta)
        self.cos = torch.from_numpy(np.tile(cos, (reqs, 1))).to(device)
        self.sin = torch.from_numpy(np.tile(sin, (reqs, 1))).to(device)
        self.mask = None
        if c.window:  # row j sees context q' >= p + j - W + 1, and the whole block
            cpos = torch.arange(context)[None, :]
            rpos = (context + torch.arange(self.B))[:, None]
            block = torch.ones(self.B, self.B, dtype=torch.bool)
            ok = torch.cat([cpos >= rpos - c.window + 1, block], 1)
            self.mask = ok.to(device)
        anchors = torch.randint(0, c.vocab, (reqs,), generator=g)
        tokens = torch.full((reqs, self.B), c.mask_token, dtype=torch.int64)
        tokens[:, 0] = anchors
        self.tokens = tokens.reshape(-1).to(device)
        self.anchors = anchors.to(device)
        self.drafts = torch.zeros(reqs, self.B, dtype=torch.int64, device=device)
        self.logits = None

    def layers(self):
        """The base logits [reqs * B, V] of the block rows."""
        c, W, T, B = self.c, self.W, self.reqs * self.B, self.B
        residual = W.embed[self.tokens]
        hidden = None
        for i, L in enumerate(W.layers):
            if hidden is not None:
                residual = (hidden.float() + residual.float()).to(torch.bfloat16)
            x = rms(residual, L["in"], c.eps)
            q = head_norm_rope(F.linear(x, L["q"]), c.n_heads, L["qn"], c.eps, self.cos, self.sin,
                               c.rotary_dim)
            k = head_norm_rope(F.linear(x, L["k"]), c.n_kv, L["kn"], c.eps, self.cos, self.sin,
                               c.rotary_dim)
            v = F.linear(x, L["v"]).view(T, c.n_kv, c.head_dim)
            kc, vc = self.k[i], self.v[i]
            kc[:, :, self.p:] = k.view(self.reqs, B, c.n_kv, c.head_dim).transpose(1, 2)
            vc[:, :, self.p:] = v.view(self.reqs, B, c.n_kv, c.head_dim).transpose(1, 2)
            qh = q.view(self.reqs, B, c.n_heads, c.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(qh, kc, vc, attn_mask=self.mask, enable_gqa=True,
                                               scale=c.head_dim ** -0.5)
            o = F.linear(o.transpose(1, 2).reshape(T, c.n_heads * c.head_dim), L["o"])
            residual = (residual.float() + o.float()).to(torch.bfloat16)
            x = rms(residual, L["post"], c.eps)
            gate, up = F.linear(x, L["g"]).float(), F.linear(x, L["u"]).float()
            gate = torch.clamp(gate, max=c.swiglu_limit)
            up = torch.clamp(up, -c.swiglu_limit, c.swiglu_limit)
            act = (gate * torch.sigmoid(c.swiglu_alpha * gate) * (up + 1.0)).to(torch.bfloat16)
            hidden = F.linear(act, L["d"])
        final = rms((hidden.float() + residual.float()).to(torch.bfloat16), W.final_norm, c.eps)
        return matmul_f32(final, W.lm_head)

    def step(self):
        """The whole draft step: base logits, then the Markov head row by row."""
        base = self.layers().view(self.reqs, self.B, -1)
        prev = self.anchors
        for j in range(self.B):
            row = base[:, j]
            if self.W.w1 is not None:
                row = row + matmul_f32(self.W.w1[prev], self.W.w2)
            prev = torch.argmax(row, dim=-1)
            self.drafts[:, j] = prev
        self.logits = base
        return self.drafts


def read_bandwidth(device):
    """Streaming read bandwidth (bytes/s): the best of 5 sums over 2 GiB."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device=device)
    best = 0.0
    for _ in range(5):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        x.sum()
        t1.record()
        torch.cuda.synchronize()
        best = max(best, x.numel() * 2 / (t0.elapsed_time(t1) * 1e-3))
    del x
    return best


def step_bytes(W, reqs, context):
    c = W.c
    keys = min(context, c.window) if c.window else context
    ctx = reqs * c.n_layers * keys * c.n_kv * c.head_dim * 2 * 2
    markov = (W.w2.numel() * 2 * c.block + reqs * c.block * c.rank * 2) if c.rank else 0
    return W.layer_bytes() + W.lm_head.numel() * 2 + markov + ctx


def time_step(s, mode, iters):
    """Median milliseconds of one step (eager calls or a graph's replays)."""
    fn = s.step
    if mode == "graph":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                s.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            s.step()
        fn = graph.replay
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1))
    return statistics.median(times)


def check(model, drafter, W, device):
    """One step at a small context against the numpy reference."""
    c = drafter.cfg
    context, reqs = 40, 2
    rng = np.random.default_rng(5)
    ctx = []
    for _ in range(reqs):
        per = []
        for _ in range(c.n_layers):
            kv = rng.uniform(-1, 1, size=(2, context, c.n_kv, c.head_dim)).astype(np.float32)
            per.append((R.bf16_round(kv[0]), R.bf16_round(kv[1])))
        ctx.append(per)
    s = DraftStep(W, reqs, context, device, ctx_kv=ctx)
    drafts = s.step().cpu().numpy()
    got = s.logits.float().cpu().numpy()
    worst, agree = 0.0, 0
    for r in range(reqs):
        anchor = int(s.anchors[r])
        ref = DR.draft_forward(model, drafter, ctx[r], context, DR.block_tokens(drafter, anchor))
        rel = np.linalg.norm(got[r] - ref, axis=1) / np.linalg.norm(ref, axis=1)
        worst = max(worst, float(rel.max()))
        _, ref_drafts = DR.draft_tokens(drafter, ref, anchor)
        agree += int(np.sum(ref_drafts == drafts[r]))
    ok = worst <= CHECK_BOUND and np.isfinite(got).all()
    print(f"check: base logits against dspark_ref, worst row relative L2 {worst:.3g} "
          f"(bound {CHECK_BOUND}); drafts equal for {agree} of {reqs * c.block}: "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--reqs", default="1,2,4")
    ap.add_argument("--context", default="1000")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    model = R.load_model(a.target)
    drafter = DR.load_drafter(a.draft, model)
    W = Weights(model, drafter, a.device)
    if a.check:
        return check(model, drafter, W, a.device)
    if a.device != "cuda":
        raise SystemExit("timing needs --device cuda (--check runs anywhere)")
    bw = read_bandwidth(a.device)
    rows = []
    print(f"read bandwidth {bw / 1e12:.2f} TB/s; drafter: {drafter.cfg.n_layers} layers, "
          f"B = {drafter.cfg.block}, Markov rank {drafter.cfg.rank}; fp32 logits: "
          f"{'torch.mm out_dtype' if _F32_OUT.get('cuda', True) else 'bf16 product widened'}")
    print("| reqs | context | mode | ms | MB read | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|")
    for reqs in (int(x) for x in a.reqs.split(",")):
        for context in (int(x) for x in a.context.split(",")):
            s = DraftStep(W, reqs, context, a.device)
            nbytes = step_bytes(W, reqs, context)
            floor = nbytes / bw * 1e3
            for mode in a.modes.split(","):
                ms = time_step(s, mode, a.iters)
                rows.append({"reqs": reqs, "context": context, "mode": mode, "ms": ms,
                             "bytes": nbytes, "floor_ms": floor, "read_bw": bw})
                print(f"| {reqs} | {context} | {mode} | {ms:.3f} | {nbytes / 1e6:.0f} | "
                      f"{floor:.3f} | {ms / floor:.2f} |")
            del s
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
