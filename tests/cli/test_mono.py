#!/usr/bin/env python3
"""The mono path (fused per-layer executor, SPEC §5) against the stock path, on the CPU.

For each model (the `tiny` preset, an MXFP8 copy, and the `small` preset cut
to three layers), `m3 generate` decodes greedily from a prompt past the sparse
threshold with `--decode mono` and with `--decode stock`, at TP 1, 2 and 4.
The CPU executor uses the stock ops' row kernels with the same summation
orders and rounding points, so the bound is bitwise: checked

- the same greedy tokens and bit-identical logits for every generated token;
- the run's stats: the prompt's three prefill chunks ran stock and every
  decode step mono;
- `--decode auto` picks mono where allowed (same stats as mono);
- on a model whose sparse MoE layers are not its last (`mid`: tiny with a
  fourth layer of sparse attention and a dense MLP), the mono path fuses
  the run in the middle (`mono_layers` [1, 2]) and the last layer runs
  stock, bit-identical as above;
- on a model with no sparse MoE layer, `--decode mono` is refused with the
  reason and `--decode auto` prints the reason once and runs stock.

Run by ctest as: test_mono.py --m3 build/m3 --work DIR
"""
import argparse
import json
import os
import random
import subprocess
import sys

import numpy as np

N_PROMPT = 600
N_GEN = 20


def run(cmd, expect_ok=True):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if expect_ok and res.returncode != 0:
        sys.exit("FAILED: %s\nstdout: %s\nstderr: %s" % (" ".join(cmd[:6]), res.stdout, res.stderr))
    return res


def generate(m3, model, prompt, decode, tp, path, extra=()):
    res = run([m3, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
               "--max-tokens", str(N_GEN), "--ignore-eos", "--json", "--max-rows", "256",
               "--threads", "2", "--tp", str(tp), "--decode", decode, "--dump-logits", path,
               *extra])
    return json.loads(res.stdout), np.load(path), res.stderr


def check_model(m3, work, name, model, vocab, tps=(1, 2, 4)):
    rng = random.Random(name)
    prompt = [rng.randrange(vocab) for _ in range(N_PROMPT)]
    ref, ref_logits, _ = generate(m3, model, prompt, "stock", 1, os.path.join(work, name + "_s.npy"))
    if ref["mono_steps"] != 0 or ref["mono_layers"] is not None:
        sys.exit("FAILED: %s: --decode stock ran %d mono steps (mono_layers %s)" %
                 (name, ref["mono_steps"], ref["mono_layers"]))
    for tp in tps:
        for decode in ("mono", "auto"):
            out, logits, err = generate(m3, model, prompt, decode, tp,
                                        os.path.join(work, "%s_%s%d.npy" % (name, decode, tp)))
            same = np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32))
            print("%s --decode %s --tp %d: mono_steps %d stock_steps %d, tokens %s, logits %s" %
                  (name, decode, tp, out["mono_steps"], out["stock_steps"],
                   "equal" if out["tokens"] == ref["tokens"] else "DIFFER",
                   "bit-identical" if same else "DIFFER"))
            if out["tokens"] != ref["tokens"] or not same:
                sys.exit("FAILED: %s --decode %s --tp %d differs from stock" % (name, decode, tp))
            # prefill chunks (3 of 256 rows) and the first token's step are
            # stock; every later decode step is mono
            if out["mono_steps"] != N_GEN - 1 or out["stock_steps"] != 3:
                sys.exit("FAILED: %s: expected %d mono and 3 stock steps, got %d and %d" %
                         (name, N_GEN - 1, out["mono_steps"], out["stock_steps"]))
            if "refused" in err:
                sys.exit("FAILED: %s: unexpected refusal: %s" % (name, err))
            if out["mono_layers"] != [1, 2]:  # each model: layer 0 dense, 1..2 sparse MoE (mid: 3
                # sparse with a dense MLP)
                sys.exit("FAILED: %s: mono_layers %s, expected [1, 2]" % (name, out["mono_layers"]))


def check_refusal(m3, work, model, vocab):
    prompt = list(range(1, 40))
    res = run([m3, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
               "--max-tokens", "4", "--decode", "mono"], expect_ok=False)
    if res.returncode == 0 or "refused" not in res.stderr or "sparse MoE" not in res.stderr:
        sys.exit("FAILED: --decode mono on a dense model: rc %d, %s" % (res.returncode, res.stderr))
    print("--decode mono refused: %s" % res.stderr.strip().splitlines()[-1])
    out, _, err = generate(m3, model, prompt, "auto", 1, os.path.join(work, "dense_auto.npy"))
    if err.count("refused") != 1 or out["mono_steps"] != 0:
        sys.exit("FAILED: --decode auto on a dense model: stderr %r, mono_steps %d" %
                 (err, out["mono_steps"]))
    print("--decode auto: %s" % err.strip().splitlines()[0])


def check_first_layer(m3, work, model, vocab):
    """M3_MONO_FIRST_LAYER (an experiment's knob) narrows the range; a bad value is refused."""
    rng = random.Random("first")
    prompt = [rng.randrange(vocab) for _ in range(N_PROMPT)]
    ref, ref_logits, _ = generate(m3, model, prompt, "stock", 1, os.path.join(work, "first_s.npy"))
    env = dict(os.environ, M3_MONO_FIRST_LAYER="2")
    res = subprocess.run([m3, "generate", "--model", model, "--prompt-ids",
                          ",".join(map(str, prompt)), "--max-tokens", str(N_GEN), "--ignore-eos",
                          "--json", "--decode", "mono", "--dump-logits",
                          os.path.join(work, "first_2.npy")],
                         capture_output=True, text=True, timeout=900, env=env)
    if res.returncode != 0:
        sys.exit("FAILED: M3_MONO_FIRST_LAYER=2: exit %d\n%s" % (res.returncode, res.stderr))
    out, logits = json.loads(res.stdout), np.load(os.path.join(work, "first_2.npy"))
    if (out["mono_steps"] != N_GEN - 1 or out["mono_layers"] != [2, 2] or
            not np.array_equal(logits.view(np.uint32), ref_logits.view(np.uint32))):
        sys.exit("FAILED: M3_MONO_FIRST_LAYER=2: mono_steps %d, mono_layers %s, logits %s the "
                 "stock path's" % (out["mono_steps"], out["mono_layers"],
                                   "equal to" if np.array_equal(logits, ref_logits) else "not"))
    env["M3_MONO_FIRST_LAYER"] = "9"
    res = subprocess.run([m3, "generate", "--model", model, "--prompt-ids", "1,2,3",
                          "--decode", "mono"], capture_output=True, text=True, timeout=900, env=env)
    if res.returncode == 0 or "M3_MONO_FIRST_LAYER=9: not a layer" not in res.stderr:
        sys.exit("FAILED: M3_MONO_FIRST_LAYER=9 not refused: exit %d, %s" %
                 (res.returncode, res.stderr.strip()))
    print("M3_MONO_FIRST_LAYER=2: mono on layer 2 only, logits equal; 9: refused")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m3", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--quick", action="store_true",
                    help="skip the largest model (the sanitizer build)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    m3 = os.path.abspath(a.m3)
    models = {}
    for name, args in [("tiny", ["--preset", "tiny", "--seed", "21"]),
                       ("tiny_mxfp8", ["--preset", "tiny", "--seed", "22", "--mxfp8"]),
                       ("small3", ["--preset", "small", "--layers", "3", "--seed", "23"]),
                       ("dense1", ["--preset", "tiny", "--layers", "1", "--seed", "24"])]:
        models[name] = os.path.join(a.work, name)
        run([m3, "synth", *args, "--out", models[name]])
    # mid: tiny's layers and a fourth of sparse attention with a dense MLP
    with open(os.path.join(models["tiny"], "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = 4
    text["moe_layer_freq"] = [0, 1, 1, 0]
    sc = text["sparse_attention_config"]
    sc["sparse_attention_freq"] = [0, 1, 1, 1]
    sc["sparse_disable_index_value"] = [0, 1, 1, 1]
    with open(os.path.join(a.work, "mid.json"), "w") as f:
        json.dump(cfg, f)
    models["mid"] = os.path.join(a.work, "mid")
    run([m3, "synth", "--config", os.path.join(a.work, "mid.json"), "--seed", "25", "--out",
         models["mid"]])
    check_model(m3, a.work, "tiny", models["tiny"], 512)
    check_model(m3, a.work, "tiny_mxfp8", models["tiny_mxfp8"], 512)
    check_model(m3, a.work, "mid", models["mid"], 512, (1, 2) if a.quick else (1, 2, 4))
    if not a.quick:
        check_model(m3, a.work, "small3", models["small3"], 8192)
    check_refusal(m3, a.work, models["dense1"], 512)
    check_first_layer(m3, a.work, models["tiny"], 512)
    print("ok")


if __name__ == "__main__":
    main()
