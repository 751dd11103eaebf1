#!/usr/bin/env python3
"""The CUDA engine on configs drawn at random from SPEC 2.1's space, against
the CPU engine (the reference: tests/cli/test_reference.py checks it against
the numpy reference on draws of the same kind, random_config there).

For each config: `m3 synth`, then greedy generation of N_GEN tokens from a
prompt longer than the config's top-k blocks (so block selection matters) on
the CPU and on the GPU: the stock path from CUDA graphs and eagerly, and the
mono path from graphs and eagerly (or its refusal, exit 1 naming the
reason, where the fused kernels do not take the shapes: every other config
is drawn with head and index dims 128 and a hidden size of 256 or 512, the
widths they take). Per GPU run:

- the tokens equal the CPU's, each row of logits within REL_BOUND (relative
  L2, the bf16 pipelines' bound of SPEC §8); or, where the tokens part, the
  rows before that within the bound and the CPU's top-2 margin at the
  parting row below twice the largest logit error seen before it (a
  near-tie: WARN, as in test_cuda_model (b)); anything else FAILs;
- eager equals graphs bit for bit (logits and tokens);
- a mono run (accepted) ran mono steps;
- for the first config, its checkpoint rewritten in the newer Hugging Face
  layout (tests/cli/test_layouts.py: stacked and fused tensors, sharded)
  gives the same GPU logits bit for bit, stock and mono.

Without a usable GPU it prints SKIP and exits 77. `--device cpu` runs the
harness on the CPU engine for both sides (its self-check: everything equal).
M3_TEST_SEED varies the draw.

With --tp N the GPU runs are tensor parallel over N GPUs (shapes the ranks
cannot split are refused, exit 1, and count as passes), against the CPU at
one rank; the newer-layout check runs at --tp 1 only.

Run: tests/gpu/cuda_configs.py --m3 build-gpu/m3 --work DIR [--count N] [--tp N]
"""
import argparse
import json
import os
import random
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "cli"))
from test_layouts import to_newer  # noqa: E402
from test_reference import random_config, synth_config  # noqa: E402

N_GEN = 16
REL_BOUND = 2e-2


def generate(m3, model, prompt, dump, extra):
    cmd = [m3, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(N_GEN), "--ignore-eos", "--json", "--dump-logits", dump, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        return res, None, None
    return res, json.loads(res.stdout), np.load(dump)


def compare(ref_tokens, ref_logits, tokens, logits):
    """(verdict, text): the GPU run against the CPU's."""
    n = min(len(ref_tokens), len(tokens))
    part = next((i for i in range(n) if ref_tokens[i] != tokens[i]), None)
    rows = n if part is None else part + 1
    if logits.shape[0] < rows or not np.all(np.isfinite(logits[:rows])):
        return "FAIL", f"logits {logits.shape}, non-finite or missing rows"
    rel = [float(np.linalg.norm(logits[i] - ref_logits[i]) / np.linalg.norm(ref_logits[i]))
           for i in range(rows)]
    before = rel if part is None else rel[:part]
    worst = max(before) if before else 0.0
    if worst > REL_BOUND:
        return "FAIL", f"relative L2 {worst:.3g} > {REL_BOUND} before any token parted"
    if part is None and len(tokens) == len(ref_tokens):
        return "PASS", f"{n} tokens equal, relative L2 <= {worst:.2g}"
    if part is None:
        return "FAIL", f"{len(tokens)} tokens against the CPU's {len(ref_tokens)}"
    err = max((float(np.abs(logits[i] - ref_logits[i]).max()) for i in range(part)), default=0.0)
    top = np.sort(ref_logits[part])[-2:]
    margin = float(top[1] - top[0])
    if margin < 2 * max(err, 1e-6):
        return "WARN", (f"tokens part at {part} (CPU {ref_tokens[part]}, GPU {tokens[part]}): "
                        f"a near-tie, margin {margin:.3g} < 2 x error {err:.3g}")
    return "FAIL", (f"tokens part at {part} (CPU {ref_tokens[part]}, GPU {tokens[part]}): "
                    f"margin {margin:.3g} >= 2 x error {err:.3g}")


def check_layout(m3, work, name, model, prompt, device, runs):
    """The newer layout of model on the GPU: bit-identical to the released one's runs."""
    newer = model + "_hf"
    to_newer(model, newer, "hf")
    out = []
    for label, extra in [("stock", ["--decode", "stock"]), ("mono", ["--decode", "mono"])]:
        if label not in runs:
            continue
        res, got, logits = generate(m3, newer, prompt, os.path.join(work, f"{name}_hf.npy"),
                                    ["--device", device, *extra])
        same = got is not None and got["tokens"] == runs[label][0] and \
            np.array_equal(logits, runs[label][1])
        out.append(("PASS" if same else "FAIL",
                    f"{name} {label}, newer checkpoint layout: "
                    + ("bit-identical" if same else
                       f"differs (exit {res.returncode}: {res.stderr.strip()[:200]})")))
    return out


def check_config(m3, work, seed, device, layout=False, extra_args=()):
    rng = random.Random(seed)
    cfg = random_config(rng)
    text = cfg.get("text_config", cfg)
    if seed % 2:  # every other config in the fused kernels' widths, so mono runs
        text["head_dim"] = 128
        text["hidden_size"] = rng.choice([256, 512])
        text["rotary_dim"] = rng.choice([32, 64, 128])
        text["sparse_attention_config"]["sparse_index_dim"] = 128
    name = f"cfg{seed}"
    mxfp8 = rng.random() < 0.25 and text["hidden_size"] % 32 == 0
    model, res = synth_config(m3, work, name, cfg, seed, mxfp8)
    if res.returncode != 0:
        return [("FAIL", f"{name}: synth: {res.stderr.strip()}")]
    sc = text["sparse_attention_config"]
    print(f"{name}: {text['num_hidden_layers']} layers, {text['num_attention_heads']}/"
          f"{text['num_key_value_heads']} heads of {text['head_dim']}, index dim "
          f"{sc['sparse_index_dim']}, hidden {text['hidden_size']}, experts "
          f"{text['num_experts_per_tok']}/{text['num_local_experts']}, top-"
          f"{sc['sparse_topk_blocks']} blocks{', mxfp8' if mxfp8 else ''}", flush=True)
    prompt = [rng.randrange(text["vocab_size"])
              for _ in range(128 * sc["sparse_topk_blocks"] + rng.randint(100, 400))]
    res, ref, ref_logits = generate(m3, model, prompt, os.path.join(work, name + "_cpu.npy"),
                                    ["--device", "cpu"])
    if ref is None:
        return [("FAIL", f"{name}: CPU run: exit {res.returncode}: {res.stderr.strip()}")]
    out = []
    runs = {}
    for label, extra in [("stock", ["--decode", "stock"]),
                         ("stock eager", ["--decode", "stock", "--no-graphs"]),
                         ("mono", ["--decode", "mono"]),
                         ("mono eager", ["--decode", "mono", "--no-graphs"])]:
        res, got, logits = generate(m3, model, prompt, os.path.join(work, f"{name}_x.npy"),
                                    ["--device", device, *extra, *extra_args])
        if got is None:
            unsupported = res.returncode == 1 and "M3_ERR_UNSUPPORTED" in res.stderr
            # the mono plan's refusals or the executor's; with --tp, shapes
            # the ranks cannot split
            refused = unsupported and (label.startswith("mono") and "mono" in res.stderr or
                                       bool(extra_args) and "tp = " in res.stderr)
            if refused:
                out.append(("PASS", f"{name} {label}: refused: "
                                    f"{res.stderr.strip().splitlines()[-1][:150]}"))
            else:
                out.append(("FAIL", f"{name} {label}: exit {res.returncode}: "
                                    f"{res.stderr.strip()[:300]}"))
            continue
        runs[label] = (got["tokens"], logits)
        verdict, text_ = compare(ref["tokens"], ref_logits, got["tokens"], logits)
        if label.startswith("mono") and got.get("mono_steps", 0) < 1:
            verdict, text_ = "FAIL", f"no mono steps ({got.get('mono_steps')}); " + text_
        out.append((verdict, f"{name} {label}: {text_}"))
    for path_ in ("stock", "mono"):
        a, b = runs.get(path_), runs.get(path_ + " eager")
        if a and b and (a[0] != b[0] or not np.array_equal(a[1], b[1])):
            out.append(("FAIL", f"{name} {path_}: eager and graph runs differ"))
    if layout and not extra_args:
        out += check_layout(m3, work, name, model, prompt, device, runs)
    return out


def device_usable(m3, work):
    res = subprocess.run([m3, "generate", "--prompt-ids", "1", "--max-tokens", "1",
                          "--device", "cuda"], capture_output=True, text=True,
                         env=dict(os.environ, M3_CACHE_DIR=work))
    return res.returncode == 0, res.stderr.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m3", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu: the harness's self-check")
    ap.add_argument("--tp", type=int, default=1,
                    help="the GPU runs at --tp N (GPUs 0 .. N-1); the CPU reference at 1")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    if a.device == "cuda":
        usable, why = device_usable(a.m3, a.work)
        if not usable:
            print(f"SKIP: no CUDA device: {why}")
            return 77
    base = int(os.environ.get("M3_TEST_SEED", "0"), 0)
    print(f"cuda_configs: seed {base} (set M3_TEST_SEED to vary), {a.count} configs, "
          f"device {a.device}, tp {a.tp}")
    results = []
    for i in range(a.count):
        extra = ("--tp", str(a.tp)) if a.tp > 1 else ()
        for verdict, text in check_config(a.m3, a.work, base * 1000 + 500 + i, a.device,
                                          layout=i == 0, extra_args=extra):
            print(f"  {verdict:4} {text}", flush=True)
            results.append(verdict)
    fails, warns = results.count("FAIL"), results.count("WARN")
    print(f"cuda_configs: {len(results)} checks, {fails} failed, {warns} warnings")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
