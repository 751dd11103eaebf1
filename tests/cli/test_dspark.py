#!/usr/bin/env python3
"""`m3 generate --draft` (DSpark speculative decoding, docs/DSPARK.md) against
plain greedy decoding and the independent numpy drafter reference
(tests/reference/dspark_ref.py).

Models: the `tiny` target (synth seed 7), a random drafter for it
(`m3 synth --draft-for`), one with `--draft-window 8`, and an "oracle"
drafter: the first one's weights with a Markov head (rank 32, written here)
that maps each token of the plain greedy continuation to the next (but one
to a wrong token), so most drafts are accepted and the all-accepted and
partly-accepted paths run too. For each:

(a) the tokens and the --dump-logits rows are bitwise those of the same
    command without --draft (greedy output never changes);
(b) every cycle's draft logits (--dump-draft-logits, [C, B, V], Markov bias
    included) agree with the reference's, computed from the teacher-forced
    target over prompt + generated tokens, to relative L2 <= REL_BOUND per
    row, and the reference's drafts equal the engine's;
(c) the "spec" record is consistent with the tokens: each step's anchor is
    the token at its position, drafts[0:n] are the next tokens and drafts[n]
    is not (unless n == B), steps follow one another (pos + n + 1), they cover
    the generated tokens, and the totals add up;
(d) the windowed drafter, with a prompt longer than its window;
(f) targets drawn at random from SPEC §2.1's space (test_reference.py's
    random_config: head and index dims, GQA groups, partial RoPE, dense and
    sparse layers, MoE, MXFP8), each with a drafter of random depth, block
    (1-15), window and weight format: (a)-(c) again;
(g) --tp 2 (CPU ranks as threads, the drafter whole on rank 0): the tokens,
    their logits and the draft logits bitwise those of --tp 1;
(h) a batch (three --prompt-ids, decoded together, two requests a draft
    step at --max-rows 16), at --tp 1 and 2: each request's tokens those of
    its prompt alone, with and without --draft, and its draft steps (the
    "spec" steps naming it) those of its prompt alone;
(e) clean refusals (exit 1 or 2, a message on stderr naming the problem, no
    traceback or crash report): --draft on a missing folder, with
    --temperature 0.7, a drafter whose hidden_size differs from the
    target's, and one with markov_head_type "gated".

Run by ctest as: test_dspark.py --m3 build/m3 --work DIR [--quick]
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REFDIR = os.path.join(HERE, "..", "reference")
REF = os.path.join(REFDIR, "dspark_ref.py")
sys.path.insert(0, REFDIR)
import dspark_ref as DR  # noqa: E402
import m3_ref as R  # noqa: E402
import test_m3_ref as TW  # noqa: E402  (its safetensors writer)
import test_reference as TR  # noqa: E402  (its random target configs)

REL_BOUND = 1e-5      # per row of draft logits: both sides round alike
N_PROMPT = 420        # > 3 x 128: the tiny target's indexer selects among blocks
N_GEN = 24
N_PROMPT_WINDOW = 30  # > the window of 8
N_GEN_WINDOW = 16
ORACLE_RANK = 32
BREAK_AT = 10         # the oracle's chain points to a wrong token after this many
COMMON = ["--threads", "2", "--max-rows", "64"]
RANDOM_TARGETS = 4   # (f); --quick: half
BAD_MARKERS = ("Traceback", "Sanitizer", "runtime error", "Segmentation", "Assertion",
               "core dumped", "stack-overflow", "Aborted")


def run(cmd, **kw):
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))}... failed ({res.returncode}):\n{res.stderr}")
    return res


def generate(m3, model, prompt, n_gen, dump, draft=None, draft_dump=None, extra=()):
    """(parsed JSON, logits [N, V] (None without dump), draft logits [C, B, V] or None)."""
    cmd = [m3, "generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-tokens", str(n_gen), "--ignore-eos", "--json", *COMMON, *extra]
    if dump:
        cmd += ["--dump-logits", dump]
    if draft:
        cmd += ["--draft", draft, "--dump-draft-logits", draft_dump]
    out = json.loads(run(cmd).stdout)
    glog = None
    if draft:  # the engine writes [steps x block, V]
        glog = np.load(draft_dump)
        glog = glog.reshape(-1, out["spec"]["block"], glog.shape[-1])
    return out, np.load(dump) if dump else None, glog


def reference_cycles(work, name, target, draft, seq, steps):
    """The reference's (logits [C, B, V], drafts [C][B]) for the engine's cycles."""
    tok_path = os.path.join(work, name + "_ref_tokens.txt")
    cyc_path = os.path.join(work, name + "_ref_cycles.json")
    out = os.path.join(work, name + "_ref.npy")
    with open(tok_path, "w") as f:
        f.write(",".join(map(str, seq)))
    with open(cyc_path, "w") as f:
        json.dump([{"pos": s["pos"], "anchor": s["anchor"]} for s in steps], f)
    res = run([sys.executable, REF, "--model", target, "--draft", draft, "--tokens", "@" + tok_path,
               "--cycles", cyc_path, "--out", out])
    return np.load(out), json.loads(res.stdout)


def check_steps(name, spec, seq, n_prompt, B, glog, vocab):
    """(c): the spec record against the token sequence prompt + generated."""
    fails = []
    steps = spec.get("steps", [])
    C = len(steps)
    if spec.get("cycles") != C:
        fails.append(f"{name}: spec.cycles {spec.get('cycles')} != {C} steps")
    if spec.get("accepted") != sum(s.get("accepted", 0) for s in steps):
        fails.append(f"{name}: spec.accepted {spec.get('accepted')} != the steps' sum")
    if spec.get("drafted") != sum(s.get("verified", -1) for s in steps):
        fails.append(f"{name}: spec.drafted {spec.get('drafted')} != the steps' verified drafts")
    if spec.get("block") != B:
        fails.append(f"{name}: spec.block {spec.get('block')} != {B}")
    if glog.shape != (C, B, vocab):
        fails.append(f"{name}: draft logits {glog.shape}, expected {(C, B, vocab)}")
        return fails
    if C == 0:
        return fails + [f"{name}: no draft cycles ran"]
    if steps[0]["pos"] != n_prompt:
        fails.append(f"{name}: first cycle at {steps[0]['pos']}, expected {n_prompt} (the first generated token)")
    for c, s in enumerate(steps):
        p, a, d, n, v = s["pos"], s["anchor"], s["drafts"], s["accepted"], s["verified"]
        tag = f"{name} cycle {c} (pos {p})"
        # the target checks B drafts, fewer when max_tokens ends inside the block
        if len(d) != B or not 0 <= n <= v <= B or (v < B and p + v + 2 != len(seq)):
            fails.append(f"{tag}: {len(d)} drafts, {v} verified, accepted {n} (B = {B})")
            continue
        if len(d) != B or not 0 <= n <= B:
            fails.append(f"{tag}: {len(d)} drafts, accepted {n} (B = {B})")
            continue
        if not n_prompt <= p < len(seq) or seq[p] != a:
            fails.append(f"{tag}: anchor {a} is not the token at its position")
        for i in range(n):
            if p + 1 + i < len(seq) and d[i] != seq[p + 1 + i]:
                fails.append(f"{tag}: draft {i} = {d[i]} counted accepted, the token is {seq[p + 1 + i]}")
        if n < v and p + 1 + n < len(seq) and d[n] == seq[p + 1 + n]:
            fails.append(f"{tag}: draft {n} = {d[n]} equals the target's token but was rejected")
        want = R.greedy_tokens(glog[c]).tolist()
        if want != d:
            fails.append(f"{tag}: drafts {d} are not the argmax of the dumped draft logits {want}")
        if c + 1 < C and steps[c + 1]["pos"] != p + n + 1:
            fails.append(f"{tag}: next cycle at {steps[c + 1]['pos']}, expected {p + n + 1}")
    last = steps[-1]
    # (one token left after the last cycle: a plain step, nothing to draft)
    if last["pos"] + last["accepted"] + 1 < len(seq) - 2:
        fails.append(f"{name}: the cycles stop at {last['pos'] + last['accepted'] + 1}, "
                     f"before the last token at {len(seq) - 1}")
    return fails


def check_spec(m3, work, name, target, draft, prompt, n_gen, vocab, need_accepts=False):
    """(a), (b), (c) for one drafter and prompt."""
    plain, plain_logits, _ = generate(m3, target, prompt, n_gen, os.path.join(work, name + "_plain.npy"))
    out, logits, glog = generate(m3, target, prompt, n_gen, os.path.join(work, name + "_spec.npy"),
                                 draft, os.path.join(work, name + "_draft.npy"))
    tokens, fails = out["tokens"], []
    if tokens != plain["tokens"]:
        fails.append(f"{name}: tokens with --draft {tokens} != without {plain['tokens']}")
    if logits.shape != plain_logits.shape or not np.array_equal(logits, plain_logits):
        fails.append(f"{name}: --dump-logits with --draft differ from without (shapes {logits.shape}, "
                     f"{plain_logits.shape})")
    # without --dump-logits no on_token reads the verify steps' rows (on a
    # GPU their greedy tokens come from m3_engine_step_greedy): the same tokens
    bare, _, _ = generate(m3, target, prompt, n_gen, None, draft, os.path.join(work, name + "_draft2.npy"))
    if bare["tokens"] != plain["tokens"]:
        fails.append(f"{name}: tokens with --draft and no --dump-logits {bare['tokens']} != "
                     f"plain {plain['tokens']}")
    spec = out.get("spec")
    if not isinstance(spec, dict):
        return fails + [f"{name}: no 'spec' object in the JSON output"]
    model = R.load_model(target)
    B = DR.load_drafter(draft, model).cfg.block
    seq = list(prompt) + list(tokens)
    fails += check_steps(name, spec, seq, len(prompt), B, glog, vocab)
    ds, vs = spec.get("draft_seconds"), spec.get("verify_seconds")
    if not (isinstance(ds, (int, float)) and isinstance(vs, (int, float)) and ds > 0 and vs > 0
            and ds + vs <= out.get("decode_seconds", 0)):
        fails.append(f"{name}: spec draft_seconds {ds} and verify_seconds {vs} are not both "
                     f"above 0 and within decode_seconds {out.get('decode_seconds')}")
    steps = spec.get("steps", [])
    if not steps or glog.shape != (len(steps), B, vocab):
        return fails
    ref, ref_drafts = reference_cycles(work, name, target, draft, seq, steps)
    rel = (np.linalg.norm((glog - ref).reshape(-1, vocab), axis=1)
           / np.linalg.norm(ref.reshape(-1, vocab), axis=1))
    if not np.all(np.isfinite(glog)):
        fails.append(f"{name}: non-finite draft logits")
    if not rel.max() <= REL_BOUND:
        bad = sorted({int(i) // B for i in np.nonzero(~(rel <= REL_BOUND))[0]})
        fails.append(f"{name}: draft logits relative error {rel.max():.3g} > {REL_BOUND} (cycles {bad[:10]})")
    for c, s in enumerate(steps):
        if ref_drafts[c] != s["drafts"]:
            fails.append(f"{name} cycle {c}: drafts {s['drafts']} != reference {ref_drafts[c]}")
    full = sum(s["accepted"] == B for s in steps)
    part = sum(0 < s["accepted"] < B for s in steps)
    print(f"{name}: {len(steps)} cycles, {spec.get('accepted')} of {spec.get('drafted')} drafts accepted "
          f"({full} cycles all accepted, {part} partly); draft logits max relative L2 error {rel.max():.3g}; "
          f"tokens and logits {'equal' if tokens == plain['tokens'] else 'DIFFER'} to plain greedy")
    if need_accepts and not spec.get("accepted"):
        fails.append(f"{name}: the oracle drafter had no draft accepted")
    return fails


def copy_drafter(src, dst, edit_config=None, tensors=None):
    """src copied to dst (one model.safetensors); edit_config(text_config dict,
    whole dict) changes config.json; tensors: full name -> (dtype, array) added or replaced."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg.get("text_config", cfg), cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    ck = R.Checkpoint(src)
    out = {}
    for name in ck.where:
        dtype, _ = ck.info(name)
        raw = ck.raw(name)
        if dtype == "BF16":
            out[name] = ("BF16", R.bf16_bits_to_f32(raw))
        elif dtype in ("F32", "F8_E4M3", "U8"):
            out[name] = (dtype, np.array(raw))
        else:
            raise RuntimeError(f"{src}: tensor {name} has dtype {dtype}, not copied")
    out.update(tensors or {})
    TW.write_safetensors(os.path.join(dst, "model.safetensors"), out)
    return dst


def set_key(key, value):
    """A config edit setting a DSpark key in whichever spelling the file uses."""
    def edit(tc, whole):
        for where in (tc, whole):
            for spelling in DR.KEYS[key]:
                if spelling in where:
                    where[spelling] = value
                    return
        tc[DR.KEYS[key][0]] = value
    return edit


def oracle_drafter(work, target, draft, first, continuation, vocab):
    """draft with a rank-ORACLE_RANK Markov head mapping each token of
    [first] + continuation to the one after it (bias 1024), but for one."""
    dr = DR.load_drafter(draft, R.load_model(target))
    seq = [first] + list(continuation)
    code = {}
    for t in seq[:-1]:
        code.setdefault(t, len(code))
    assert len(code) <= ORACLE_RANK
    w1 = np.zeros((vocab, ORACLE_RANK), np.float32)
    w2 = np.zeros((vocab, ORACLE_RANK), np.float32)
    for i, (t, nxt) in enumerate(zip(seq, seq[1:])):
        if i == BREAK_AT:             # one wrong successor: a cycle also stops mid-block
            nxt = (nxt + 1) % vocab
        w1[t, code[t]] = 1.0
        w2[nxt, code[t]] = 1024.0
    pre = dr.prefix + "markov_head."
    return copy_drafter(draft, os.path.join(work, "D_oracle"), set_key("rank", ORACLE_RANK),
                        {pre + "markov_w1.weight": ("BF16", w1), pre + "markov_w2.weight": ("BF16", w2)})


def expect_refusal(m3, name, args, needles):
    """(e): exit 1 or 2, stderr non-empty naming one of needles, no crash report."""
    res = subprocess.run([str(a) for a in [m3, *args]], capture_output=True, text=True, timeout=300)
    err = res.stderr
    problems = []
    if res.returncode not in (1, 2):
        problems.append(f"exit {res.returncode}, expected 1 or 2")
    if not err.strip():
        problems.append("no message on stderr")
    elif not any(n in err for n in needles):
        problems.append(f"stderr names none of {needles}")
    problems += [f"stderr holds {m!r}" for m in BAD_MARKERS if m in err]
    print(f"refusal {name}: exit {res.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}")
    return [f"refusal {name}: {'; '.join(problems)}\n  stderr: {err.strip()[:500]}"] if problems else []


def check_refusals(m3, work, target, draft, prompt):
    base = ["generate", "--model", target, "--prompt-ids", ",".join(map(str, prompt[:20])),
            "--max-tokens", "4", "--ignore-eos", *COMMON]
    fails = []
    missing = os.path.join(work, "no_such_drafter")
    fails += expect_refusal(m3, "missing folder", base + ["--draft", missing], [missing, "draft"])
    fails += expect_refusal(m3, "temperature", base + ["--draft", draft, "--temperature", "0.7", "--seed", "1"],
                            ["temperature"])
    model = R.load_model(target)
    wide = copy_drafter(draft, os.path.join(work, "D_hidden"),
                        lambda tc, whole: tc.update(hidden_size=2 * model.cfg.hidden))
    fails += expect_refusal(m3, "hidden_size", base + ["--draft", wide], ["hidden_size"])
    gated = copy_drafter(draft, os.path.join(work, "D_gated"), set_key("head_type", "gated"))
    fails += expect_refusal(m3, "gated head", base + ["--draft", gated], ["markov_head_type"])
    for d, what in ((wide, "hidden_size"), (gated, "markov_head_type")):   # the reference agrees
        try:
            DR.load_drafter(d, model)
            fails.append(f"refusal {what}: the reference accepts the drafter")
        except R.RefError:
            pass
    return fails


def check_tp(m3, work, name, target, draft, prompt, n_gen):
    """(g): --tp 2 against --tp 1, both with the drafter."""
    runs = []
    for tp in (1, 2):
        runs.append(generate(m3, target, prompt, n_gen, os.path.join(work, f"{name}_tp{tp}.npy"),
                             draft, os.path.join(work, f"{name}_tp{tp}_draft.npy"),
                             extra=("--tp", str(tp))))
    (a, la, ga), (b, lb, gb) = runs
    same = (a["tokens"] == b["tokens"] and np.array_equal(la, lb) and np.array_equal(ga, gb)
            and a["spec"]["steps"] == b["spec"]["steps"])
    print(f"{name}: --tp 2 {'equals' if same else 'DIFFERS from'} --tp 1 (tokens, logits, drafts, "
          f"draft logits)")
    return [] if same else [f"{name}: --tp 2 differs from --tp 1"]


def batch_run(m3, model, prompts, n_gen, draft=None, extra=()):
    """The parsed JSON of one `m3 generate` over several prompts."""
    cmd = [m3, "generate", "--model", model, "--max-tokens", str(n_gen), "--ignore-eos", "--json",
           "--threads", "2", "--max-rows", "16", *extra]
    for p in prompts:
        cmd += ["--prompt-ids", ",".join(map(str, p))]
    if draft:
        cmd += ["--draft", draft]
    return json.loads(run(cmd).stdout)


def check_batch(m3, target, draft, prompts, n_gen):
    """(h): a batch of prompts against each prompt alone."""
    alone = [batch_run(m3, target, [p], n_gen, draft) for p in prompts]
    fails = []
    for tp in (1, 2):
        plain = batch_run(m3, target, prompts, n_gen, extra=("--tp", str(tp)))
        spec = batch_run(m3, target, prompts, n_gen, draft, extra=("--tp", str(tp)))
        reqs, sreqs = plain.get("requests", []), spec.get("requests", [])
        steps = spec.get("spec", {}).get("steps", [])
        if len(reqs) != len(prompts) or len(sreqs) != len(prompts):
            fails.append(f"batch --tp {tp}: {len(reqs)} and {len(sreqs)} requests in the output, "
                         f"not {len(prompts)}")
            continue
        for r, a in enumerate(alone):
            if reqs[r]["tokens"] != a["tokens"] or sreqs[r]["tokens"] != a["tokens"]:
                fails.append(f"batch --tp {tp}: request {r}'s tokens differ from its prompt alone")
            mine = [{k: v for k, v in st.items() if k != "request"}
                    for st in steps if st.get("request") == r]
            theirs = [{k: v for k, v in st.items() if k != "request"} for st in a["spec"]["steps"]]
            if mine != theirs:
                fails.append(f"batch --tp {tp}: request {r}'s draft steps differ from its prompt "
                             f"alone ({len(mine)} against {len(theirs)})")
        shared = spec["spec"].get("batch_steps", 0) < spec["spec"].get("cycles", 0)
        if not shared:
            fails.append(f"batch --tp {tp}: the requests never shared a draft step")
        # the CPU's rows round alike at any count: one verify step a cycle
        if spec["spec"].get("verify_steps") != spec["spec"].get("batch_steps"):
            fails.append(f"batch --tp {tp}: {spec['spec'].get('verify_steps')} verify steps for "
                         f"{spec['spec'].get('batch_steps')} cycles on the CPU")
        print(f"batch of {len(prompts)} at --tp {tp}: {spec['spec'].get('cycles')} cycles in "
              f"{spec['spec'].get('batch_steps')} steps; tokens and draft steps "
              f"{'equal' if not fails else 'DIFFER from'} each prompt's alone")
    return fails


def check_random(m3, work, seed):
    """(f): a random target and a random drafter for it."""
    rng = random.Random(seed)
    cfg = TR.random_config(rng)
    text = cfg.get("text_config", cfg)
    name = f"random_target{seed}"
    target, res = TR.synth_config(m3, work, name, cfg, seed, False)
    if res.returncode != 0:
        return [f"{name}: synth: {res.stderr.strip()}"]
    block = rng.randint(1, 15)
    layers = rng.randint(1, 3)
    window = rng.choice([0, 0, block, rng.randint(block, 60)])
    mxfp8 = text["hidden_size"] % 32 == 0 and rng.random() < 0.3
    draft = os.path.join(work, name + "_draft")
    run([m3, "synth", "--draft-for", target, "--seed", str(seed), "--out", draft,
         "--layers", str(layers), "--draft-block", str(block)]
        + (["--draft-window", str(window)] if window else []) + (["--mxfp8"] if mxfp8 else []))
    print(f"{name}: drafter of {layers} layers, B = {block}, window {window or 'none'}"
          f"{', mxfp8' if mxfp8 else ''}")
    vocab = text["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(40, 300))]
    return check_spec(m3, work, name, target, draft, prompt, 12, vocab)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m3", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--quick", action="store_true", help="the sanitizer build: fewer tokens")
    args = ap.parse_args()
    m3, work = args.m3, args.work
    os.makedirs(work, exist_ok=True)
    n_gen = N_GEN // 2 if args.quick else N_GEN

    target = os.path.join(work, "T")
    run([m3, "synth", "--preset", "tiny", "--seed", "7", "--out", target])
    draft = os.path.join(work, "D")
    run([m3, "synth", "--draft-for", target, "--seed", "9", "--out", draft])
    draft_w = os.path.join(work, "D_window")
    run([m3, "synth", "--draft-for", target, "--seed", "10", "--draft-window", "8", "--out", draft_w])
    model = R.load_model(target)
    vocab = model.cfg.vocab
    failures = []
    try:
        dcfg = DR.load_drafter(draft, model).cfg
        wcfg = DR.load_drafter(draft_w, model).cfg
        print(f"drafter: {dcfg.n_layers} layers, B = {dcfg.block}, taps {dcfg.taps}, mask token "
              f"{dcfg.mask_token}, Markov rank {dcfg.rank}; windowed drafter: W = {wcfg.window}")
        if wcfg.window != 8:
            failures.append(f"--draft-window 8 wrote a drafter with window {wcfg.window}")
    except R.RefError as e:
        print(f"FAIL: the reference refuses the synthesized drafter: {e}")
        return 1

    rng = random.Random("dspark")
    prompt = [rng.randrange(vocab) for _ in range(N_PROMPT)]
    failures += check_spec(m3, work, "random", target, draft, prompt, n_gen, vocab)

    # (d) a sliding window, with a prompt longer than it
    prompt_w = [rng.randrange(vocab) for _ in range(N_PROMPT_WINDOW)]
    failures += check_spec(m3, work, "window", target, draft_w, prompt_w, N_GEN_WINDOW, vocab)

    # an oracle head: drafts follow the plain greedy continuation, so most are accepted
    plain, _, _ = generate(m3, target, prompt, n_gen, os.path.join(work, "oracle_seed.npy"))
    toks = plain["tokens"]
    oracle = oracle_drafter(work, target, draft, toks[0], toks[1:], vocab)
    failures += check_spec(m3, work, "oracle", target, oracle, prompt, n_gen, vocab, need_accepts=True)

    # (g) tensor parallel ranks
    failures += check_tp(m3, work, "oracle_tp", target, oracle, prompt, n_gen)

    # (h) a batch: the oracle's prompt (most drafts accepted) and two others
    others = [[rng.randrange(vocab) for _ in range(n)] for n in (150, 60)]
    failures += check_batch(m3, target, oracle, [prompt] + others, n_gen)

    # (e) refusals
    failures += check_refusals(m3, work, target, draft, prompt)

    # (f) random targets and drafters
    base = int(os.environ.get("M3_TEST_SEED", "0"), 0)
    for i in range(RANDOM_TARGETS // 2 if args.quick else RANDOM_TARGETS):
        failures += check_random(m3, work, 7000 + base * 1000 + i)

    for f in failures:
        print("FAIL:", f)
    print("dspark:", "FAILED" if failures else "passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
