#!/usr/bin/env python3
"""Checkpoint layouts (SPEC 2.2): the newer Hugging Face names load to the
same model as the released ones.

`m3 synth` writes the released layout (language_model.model.*,
block_sparse_moe.experts.{e}.w1/w2/w3, self_attn.index_*). This test
rewrites such a checkpoint, tensor bytes unchanged, into the newer layouts
the loader accepts and checks that `m3 generate` gives the same logits bit
for bit and the same tokens, at --tp 1 and --tp 2 (the shards are views of
the fused tensors):

- `hf`: prefix model.language_model. with lm_head.weight (untied);
  self_attn.indexer.{q,k}_{proj,norm}; mlp.gate, mlp.gate.e_score_correction_bias;
  stacked experts mlp.experts.gate_up_proj [E, 2I, H] (gate rows first) and
  mlp.experts.down_proj [E, H, I], with MXFP8 scales
  mlp.experts.{gate_up,down}_proj_scale_inv; fused
  mlp.shared_experts.gate_up_proj.weight and mlp.gate_up_proj.weight (dense
  layers); written as two shards with model.safetensors.index.json;
- `hf-suffix`: the same with the stacked experts named *.weight, the bias at
  mlp.e_score_correction_bias and a bare `model.` prefix, one file.

Both for a bf16 and an MXFP8 checkpoint. Then a broken one: a stacked
gate_up_proj with the wrong shape is refused, naming the tensor.

Run by ctest as: test_layouts.py --m3 build/m3 --work DIR [--quick] (the
sanitizer build: `hf` for bf16, `hf-suffix` for MXFP8, --tp 1 only)
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

from bad_input_harness import St  # the tests' safetensors codec


def fail(msg):
    sys.exit("FAILED: " + msg)


def run(cmd, ok=True):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if ok and res.returncode != 0:
        fail(f"{' '.join(cmd[:3])}: exit {res.returncode}: {res.stderr.strip()}")
    return res


def stack(parts):
    """[rows, k] tensors of one dtype -> concatenated rows (fuse) as bytes"""
    dtypes = {p[0] for p in parts}
    assert len(dtypes) == 1 and all(p[1][1:] == parts[0][1][1:] for p in parts)
    return b"".join(p[2] for p in parts)


def to_newer(src, dst, variant):
    """Rewrite the released checkpoint in src into a newer layout in dst."""
    t = St(os.path.join(src, "model.safetensors")).tensors()
    pre = "language_model.model."
    new_pre = "model.language_model." if variant == "hf" else "model."
    out = {}
    layers = sorted({int(m.group(1)) for n in t for m in [re.match(pre + r"layers\.(\d+)\.", n)]
                     if m})
    for name, v in t.items():
        if name == "language_model.lm_head.weight":
            out["lm_head.weight"] = v
        elif name.startswith(pre) and ".layers." not in "." + name[len(pre):]:
            out[new_pre + name[len(pre):]] = v
    for i in layers:
        lp = f"{pre}layers.{i}."
        np_ = f"{new_pre}layers.{i}."
        ln = {n[len(lp):]: v for n, v in t.items() if n.startswith(lp)}
        for n, v in ln.items():
            if n.startswith("self_attn.index_"):
                rest = n[len("self_attn.index_"):]  # q_proj.weight, k_norm.weight, ...
                out[np_ + "self_attn.indexer." + rest] = v
            elif n.startswith(("self_attn.", "input_layernorm", "post_attention_layernorm")):
                out[np_ + n] = v
        moe = any(n.startswith("block_sparse_moe.") for n in ln)
        if moe:
            out[np_ + "mlp.gate.weight"] = ln["block_sparse_moe.gate.weight"]
            if "block_sparse_moe.e_score_correction_bias" in ln:
                where = "mlp.gate." if variant == "hf" else "mlp."
                out[np_ + where + "e_score_correction_bias"] = \
                    ln["block_sparse_moe.e_score_correction_bias"]
            E = 1 + max(int(m.group(1)) for n in ln
                        for m in [re.match(r"block_sparse_moe\.experts\.(\d+)\.", n)] if m)
            ex = lambda e, w, s="weight": ln[f"block_sparse_moe.experts.{e}.{w}.{s}"]  # noqa: E731
            suffix = ".weight" if variant == "hf-suffix" else ""
            for kind, parts_of in (("gate_up_proj", lambda e, s: [ex(e, "w1", s), ex(e, "w3", s)]),
                                   ("down_proj", lambda e, s: [ex(e, "w2", s)])):
                w = [p for e in range(E) for p in parts_of(e, "weight")]
                rows = sum(p[1][0] for p in parts_of(0, "weight"))
                out[np_ + f"mlp.experts.{kind}{suffix}"] = (w[0][0], [E, rows, w[0][1][1]],
                                                            stack(w))
                if w[0][0] == "F8_E4M3":
                    s = [p for e in range(E) for p in parts_of(e, "weight_scale_inv")]
                    out[np_ + f"mlp.experts.{kind}_scale_inv"] = ("U8", [E, rows, s[0][1][1]],
                                                                  stack(s))
            sh = "block_sparse_moe.shared_experts."
            if sh + "gate_proj.weight" in ln:
                fuse(out, np_ + "mlp.shared_experts.", ln, sh)
        else:
            fuse(out, np_ + "mlp.", ln, "mlp.")
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    if variant == "hf":  # two shards and an index
        names = sorted(out)
        halves = [names[: len(names) // 2], names[len(names) // 2:]]
        weight_map = {}
        for k, part in enumerate(halves):
            fname = f"model-{k + 1:05d}-of-00002.safetensors"
            St.from_tensors({n: out[n] for n in part}).write(os.path.join(dst, fname))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    else:
        St.from_tensors(out).write(os.path.join(dst, "model.safetensors"))


def fuse(out, new_base, ln, old_base):
    """gate_proj + up_proj -> gate_up_proj.weight (and its MXFP8 scale)"""
    g, u = ln[old_base + "gate_proj.weight"], ln[old_base + "up_proj.weight"]
    out[new_base + "gate_up_proj.weight"] = (g[0], [g[1][0] + u[1][0], g[1][1]], stack([g, u]))
    if g[0] == "F8_E4M3":
        gs, us = ln[old_base + "gate_proj.weight_scale_inv"], ln[old_base + "up_proj.weight_scale_inv"]
        out[new_base + "gate_up_proj.weight_scale_inv"] = ("U8", [gs[1][0] + us[1][0], gs[1][1]],
                                                           stack([gs, us]))
    out[new_base + "down_proj.weight"] = ln[old_base + "down_proj.weight"]
    if old_base + "down_proj.weight_scale_inv" in ln:
        out[new_base + "down_proj.weight_scale_inv"] = ln[old_base + "down_proj.weight_scale_inv"]


def generate(m3, model, dump, *extra):
    prompt = ",".join(str((i * 37) % 500) for i in range(450))
    res = run([m3, "generate", "--model", model, "--prompt-ids", prompt, "--max-tokens", "6",
               "--ignore-eos", "--json", "--dump-logits", dump, "--threads", "2", *extra])
    return json.loads(res.stdout)["tokens"], np.load(dump)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m3", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--quick", action="store_true",
                    help="the sanitizer build: one layout per dtype, --tp 1 only")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    for name, extra in (("bf16", []), ("mxfp8", ["--mxfp8"])):
        src = os.path.join(a.work, name)
        run([a.m3, "synth", "--preset", "tiny", "--seed", "21", "--out", src, *extra])
        ref_tokens, ref = generate(a.m3, src, os.path.join(a.work, name + ".npy"))
        variants = ("hf", "hf-suffix")
        if a.quick:
            variants = variants[:1] if name == "bf16" else variants[1:]
        for variant in variants:
            dst = os.path.join(a.work, f"{name}_{variant}")
            to_newer(src, dst, variant)
            # the TP shards take views of the fused tensors too
            for tp in ("1",) if a.quick else ("1", "2"):
                tokens, logits = generate(a.m3, dst, os.path.join(a.work, f"{name}_{variant}.npy"),
                                          "--tp", tp)
                if tokens != ref_tokens or not np.array_equal(logits.view(np.uint32),
                                                              ref.view(np.uint32)):
                    fail(f"{name} {variant} --tp {tp}: logits or tokens differ from the "
                         f"released layout's")
            print(f"{name} {variant}: {len(os.listdir(dst)) - 1} checkpoint file(s), "
                  f"logits bit-identical to the released layout's at --tp "
                  f"{'1' if a.quick else '1 and 2'}")
    # a stacked gate_up_proj of the wrong shape: refused with its name
    bad = os.path.join(a.work, "mxfp8_hf-suffix" if a.quick else "bf16_hf-suffix")
    t = St(os.path.join(bad, "model.safetensors")).tensors()
    key = next(n for n in t if n.endswith("mlp.experts.gate_up_proj.weight"))
    dtype, shape, raw = t[key]
    t[key] = (dtype, [shape[0], shape[1] // 2, shape[2]], raw[: len(raw) // 2])
    St.from_tensors(t).write(os.path.join(bad, "model.safetensors"))
    res = run([a.m3, "generate", "--model", bad, "--prompt-ids", "1,2,3"], ok=False)
    if res.returncode != 1 or key not in res.stderr:
        fail(f"a short {key}: exit {res.returncode}: {res.stderr.strip()}")
    print(f"wrong shape refused: {res.stderr.strip().splitlines()[-1]}")
    print("test_layouts: passed")


if __name__ == "__main__":
    main()
