#!/usr/bin/env python3
"""Bad-input tests for the `m3` command-line program: arguments.

Every case runs `m3 generate` or `m3 synth` with one bad argument (a
missing or malformed value, an out-of-range number, a conflicting option,
a path that cannot be used) and checks that the program refuses it the way
the CLI promises (bad_input_harness.py says how; test_bad_input.py holds
the checkpoint cases): exit status 2 for a usage error or 1 for a runtime
failure, stderr naming the argument and value, no sanitizer or crash
report, no hang.

Usage: test_bad_args.py --m3 PATH_TO_M3 --work SCRATCH_DIR [-k SUBSTRING] [-v]
Python 3 standard library only.
"""
import json
import os
import shutil
import stat
import subprocess
import sys

import bad_input_harness as H
from bad_input_harness import *  # noqa: F401,F403 (case, Failure, the checkpoint helpers)


# ------------------------------------------------------------------ generate arguments

@case
def gen_token_id_equal_vocab():
    expect_fail(gen_args(H.GOOD, ids="1,512,3"), ["token id 512", "vocabulary"], rc=1)


@case
def gen_token_id_far_beyond_vocab():
    expect_fail(gen_args(H.GOOD, ids="2147483647"), ["token id 2147483647"], rc=1)


@case
def gen_token_id_beyond_int32():
    expect_fail(gen_args(H.GOOD, ids="1,4294967296"), ["--prompt-ids", "bad entry 1"], rc=2)


@case
def gen_token_id_negative():
    expect_fail(gen_args(H.GOOD, ids="1,-2,3"), ["--prompt-ids", "bad entry 1", "-2"], rc=2)


@case
def gen_prompt_ids_garbage():
    expect_fail(gen_args(H.GOOD, ids="1,two,3"), ["--prompt-ids", "bad entry 1", "two"], rc=2)


@case
def gen_prompt_ids_empty_entry():
    expect_fail(gen_args(H.GOOD, ids="1,,3"), ["--prompt-ids", "bad entry 1"], rc=2)


@case
def gen_prompt_ids_trailing_comma():
    expect_fail(gen_args(H.GOOD, ids="1,2,"), ["--prompt-ids ends with a comma"], rc=2)


@case
def gen_prompt_ids_float():
    expect_fail(gen_args(H.GOOD, ids="1.5"), ["--prompt-ids", "bad entry 0"], rc=2)


@case
def gen_prompt_ids_empty():
    expect_fail(gen_args(H.GOOD, ids=""), ["prompt is empty"], rc=(1, 2))


@case
def gen_prompt_text_empty():
    expect_fail(gen_args(H.GOOD, "--prompt", "", ids=None), ["prompt is empty"], rc=(1, 2))


@case
def gen_prompt_longer_than_context():
    d = with_config("gen_prompt_longer_than_context", _set_text("max_position_embeddings", 100))
    ids = ",".join(str(i % 500 + 1) for i in range(150))
    expect_fail(gen_args(d, ids=ids), ["prompt of 150 tokens", "the limit is 100"], rc=1)


@case
def gen_prompt_plus_tokens_longer_than_context():
    d = with_config("gen_prompt_plus_tokens_longer_than_context",
                    _set_text("max_position_embeddings", 100))
    ids = ",".join(str(i % 500 + 1) for i in range(90))
    expect_fail(gen_args(d, "--ignore-eos", ids=ids, max_tokens=20),
                ["prompt of 90 tokens plus 20 new tokens", "the limit is 100"], rc=1)


@case
def gen_max_tokens_negative():
    expect_fail(gen_args(H.GOOD, max_tokens=-1), ["--max-tokens = -1 is out of range"], rc=2)


@case
def gen_max_tokens_garbage():
    expect_fail(gen_args(H.GOOD, max_tokens="lots"), ["--max-tokens expects an integer", "lots"],
                rc=2)


@case
def gen_max_tokens_overflow():
    expect_fail(gen_args(H.GOOD, max_tokens="99999999999999999999999"),
                ["--max-tokens expects an integer"], rc=2)


@case
def gen_max_tokens_missing_value():
    expect_fail(["generate", "--model", H.GOOD, "--prompt-ids", "1,2,3", "--max-tokens"],
                ["--max-tokens needs a value"], rc=2)


@case
def gen_unknown_option():
    expect_fail(gen_args(H.GOOD, "--frobnicate", "3"), ["unknown option '--frobnicate'"], rc=2)


@case
def gen_unknown_command():
    expect_fail(["generat", "--model", H.GOOD], ["unknown command 'generat'"], rc=2)


@case
def gen_no_command():
    expect_fail([], ["usage: m3"], rc=2)


@case
def gen_temperature_negative():
    expect_fail(gen_args(H.GOOD, "--temperature", "-1"), ["--temperature = -1 is out of range"],
                rc=2)


@case
def gen_temperature_nan():
    expect_fail(gen_args(H.GOOD, "--temperature", "nan"), ["--temperature expects a number"], rc=2)


@case
def gen_temperature_inf():
    expect_fail(gen_args(H.GOOD, "--temperature", "inf"), ["--temperature expects a number"], rc=2)


@case
def gen_top_p_zero():
    expect_fail(gen_args(H.GOOD, "--temperature", "1", "--top-p", "0"),
                ["--top-p = 0 is out of range"], rc=2)


@case
def gen_top_p_above_one():
    expect_fail(gen_args(H.GOOD, "--temperature", "1", "--top-p", "1.5"),
                ["--top-p = 1.5 is out of range"], rc=2)


@case
def gen_top_k_negative():
    expect_fail(gen_args(H.GOOD, "--top-k", "-3"), ["--top-k = -3 is out of range"], rc=2)


@case
def gen_seed_negative():
    expect_fail(gen_args(H.GOOD, "--seed", "-1"), ["--seed = -1 is out of range"], rc=2)


@case
def gen_threads_too_many():
    expect_fail(gen_args(H.GOOD, "--threads", "100000"), ["--threads = 100000 is out of range"],
                rc=2)


@case
def gen_max_rows_zero():
    expect_fail(gen_args(H.GOOD, "--max-rows", "0"), ["--max-rows = 0 is out of range"], rc=2)


@case
def gen_neither_prompt_nor_ids():
    expect_fail(gen_args(H.GOOD, ids=None), ["give a prompt", "--prompt", "--prompt-ids"], rc=2)


# several prompts make a batch: each is checked and named by its index

@case
def gen_batch_second_prompt_empty():
    expect_fail(gen_args(H.GOOD, "--prompt", ""), ["prompt is empty", "prompt 1"], rc=2)


@case
def gen_batch_second_prompt_garbage():
    expect_fail(gen_args(H.GOOD, "--prompt-ids", "4,x"), ["bad entry 1", "in prompt 1"], rc=2)


@case
def gen_batch_dump_logits():
    expect_fail(gen_args(H.GOOD, "--prompt", "hi", "--dump-logits",
                         os.path.join(H.WORK, "x.npy")),
                ["--dump-logits takes one prompt", "2 were given"], rc=2)


@case
def gen_batch_too_many_prompts():
    many = []
    for i in range(257):
        many += ["--prompt-ids", str(i + 1)]
    expect_fail(gen_args(H.GOOD, *many, ids=None), ["at most 256 prompts"], rc=2)


@case
def gen_batch_prompt_longer_than_context():
    d = with_config("gen_batch_prompt_longer_than_context",
                    _set_text("max_position_embeddings", 100))
    ids = ",".join(str(i % 500 + 1) for i in range(150))
    expect_fail(gen_args(d, "--prompt-ids", ids), ["prompt 1 of the batch", "prompt of 150 tokens",
                                                   "the limit is 100"], rc=1)


@case
def gen_device_nonsense():
    expect_fail(gen_args(H.GOOD, "--device", "tpu9"), ["--device tpu9: expected cpu or cuda"], rc=2)


@case
def gen_decode_nonsense():
    expect_fail(gen_args(H.GOOD, "--decode", "fast"),
                ["--decode fast: expected stock, mono or auto"], rc=2)


@case
def gen_tp_out_of_range():
    expect_fail(gen_args(H.GOOD, "--tp", "0"), ["--tp"], rc=2)
    expect_fail(gen_args(H.GOOD, "--tp", "9"), ["--tp"], rc=2)
    expect_fail(gen_args(H.GOOD, "--tp", "two"), ["--tp"], rc=2)


@case
def gen_tp_does_not_divide():
    # the good checkpoint is the tiny preset: 4 query heads, 2 KV heads
    expect_fail(gen_args(H.GOOD, "--tp", "3"), ["tp = 3", "num_attention_heads = 4"], rc=1)


@case
def gen_indexer_cp_on_cuda():
    expect_fail(gen_args(H.GOOD, "--indexer-cp", "--device", "cuda"), ["--indexer-cp", "cuda"],
                rc=1)


@case
def bench_usage():
    expect_fail(["bench"], ["expected 'layer', 'linear', 'indexer' or 'draft'"], rc=2)
    expect_fail(["bench", "draft", "--model", H.GOOD], ["give both --model and --draft"], rc=2)
    expect_fail(["bench", "draft", "--model", H.GOOD, "--draft", H.GOOD, "--requests", "9"],
                ["--requests"], rc=2)
    expect_fail(["bench", "draft", "--model", H.GOOD, "--draft", H.GOOD, "--requests", "0"],
                ["--requests"], rc=2)
    expect_fail(["bench", "draft", "--model", H.GOOD, "--draft", H.GOOD, "--context", "0"],
                ["--context"], rc=2)
    expect_fail(["bench", "draft", "--frobnicate", "1"], ["unknown option"], rc=2)
    expect_fail(["bench", "layer", "--model", H.GOOD, "--warmup-ms", "-5"],
                ["--warmup-ms = -5 is out of range"], rc=2)
    expect_fail(["bench", "layer", "--model", H.GOOD, "--warmup-ms", "soon"],
                ["--warmup-ms expects an integer"], rc=2)
    expect_fail(["bench", "layer", "--model", H.GOOD, "--span", "0"],
                ["--span = 0 is out of range"], rc=2)
    # checked against the model before any device is touched
    expect_fail(["bench", "layer", "--model", H.GOOD, "--layer", "0", "--span", "200"],
                ["span 200 from layer 0", "layers"], rc=1)
    expect_fail(["bench", "indexer", "--world", "0"], ["--world"], rc=2)
    expect_fail(["bench", "indexer", "--world", "65"], ["--world"], rc=2)
    expect_fail(["bench", "indexer", "--batch", "x"], ["--batch"], rc=2)
    expect_fail(["bench", "indexer", "--min-blocks", "0"], ["--min-blocks"], rc=2)
    expect_fail(["bench", "indexer", "--target-grid", "-3"], ["--target-grid"], rc=2)
    expect_fail(["bench", "indexer", "--frobnicate", "1"], ["unknown option"], rc=2)


@case
def bench_indexer_without_gpu():
    """Without a usable GPU: a clear error, exit 1; with one, a table."""
    code, out, err, cmd, dt = run_m3(["bench", "indexer", "--batch", "1", "--context", "300",
                                      "--world", "1,2", "--iters", "1"])
    if code == 0:
        if "| batch | context | world |" not in out:
            raise Failure(f"exit 0 without the table\n  command: {shell(cmd)}\n  out: {out}")
        return
    if code != 1 or not REPORT_RE.search(err) or any(m in err for m in BAD_MARKERS):
        raise Failure(f"exit {code}, stderr: {err.strip()[:2000]}\n  command: {shell(cmd)}")


@case
def bench_draft_checks():
    """`m3 bench draft` checks its drafter before the device: a target as the
    drafter is refused by name; a real drafter without a GPU gets the
    device's error, exit 1 (with one, a table of the step's parts)."""
    expect_fail(["bench", "draft", "--model", H.GOOD, "--draft", H.GOOD], ["not a DSpark drafter"],
                rc=1)
    d = synth_out("bench_draft_checks")
    run_m3(["synth", "--draft-for", H.GOOD, "--out", d, "--layers", "1"])
    code, out, err, cmd, dt = run_m3(["bench", "draft", "--model", H.GOOD, "--draft", d,
                                      "--requests", "1", "--context", "200", "--iters", "2"])
    if code == 0:
        if "| requests | context | part |" not in out or "| markov |" not in out:
            raise Failure(f"exit 0 without the table\n  command: {shell(cmd)}\n  out: {out}")
        return
    if code != 1 or not REPORT_RE.search(err) or any(m in err for m in BAD_MARKERS):
        raise Failure(f"exit {code}, stderr: {err.strip()[:2000]}\n  command: {shell(cmd)}")


@case
def bench_layer_small_preset():
    """A preset of fewer than 4 layers is benchmarked whole (the --layers
    default is 4 only for larger ones); without a GPU the error is the
    device's, exit 1."""
    code, out, err, cmd, dt = run_m3(["bench", "layer", "--preset", "tiny", "--rows", "1",
                                      "--context", "4096", "--path", "stock", "--iters", "1"])
    if "layers = 4" in err:
        raise Failure(f"the default --layers was applied to tiny's 3 layers: {err.strip()}")
    if code == 0:
        return
    if code != 1 or not REPORT_RE.search(err) or any(m in err for m in BAD_MARKERS):
        raise Failure(f"exit {code}, stderr: {err.strip()[:2000]}\n  command: {shell(cmd)}")


@case
def gen_cuda_shapes_refused_before_upload():
    """A model the CUDA kernels cannot run (head_dim 48) is refused when the
    engine is created, naming the shape, before the device is touched (so
    the same message with or without a GPU); a build without CUDA says so."""
    d = case_dir("gen_cuda_shapes_refused_before_upload")
    cfg = load_config()
    cfg["text_config"]["head_dim"] = 48
    cfg["text_config"]["rotary_dim"] = 24
    cfg["text_config"].pop("partial_rotary_factor", None)
    path = os.path.join(d, "config.json.in")
    with open(path, "w") as f:
        json.dump(cfg, f)
    code, out, err, cmd, dt = run_m3(["synth", "--config", path, "--out", d])
    if code != 0:
        raise Failure(f"synth: exit {code}: {err.strip()}\n  command: {shell(cmd)}")
    if "no CUDA backend" in run_m3(gen_args(H.GOOD, "--device", "cuda"))[2]:
        expect_fail(gen_args(d, "--device", "cuda"), ["no CUDA backend"], rc=1)
    else:
        expect_fail(gen_args(d, "--device", "cuda"),
                    ["the CUDA backend does not take this model", "head_dim 48"], rc=1)


@case
def gen_tp_on_cuda_too_few_gpus():
    # one GPU per rank: refused where fewer than 2 GPUs (or no CUDA build);
    # on a machine with 2 or more it is no bad input (scripts/gpu-check)
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.count("GPU ") >= 2:
        return
    expect_fail(gen_args(H.GOOD, "--tp", "2", "--device", "cuda"), ["--tp 2 over GPUs"], rc=1)


@case
def gen_model_empty_dir():
    d = case_dir("gen_model_empty_dir")
    expect_fail(gen_args(d), [d, "config.json"], rc=1)


@case
def gen_model_missing_dir():
    d = os.path.join(H.WORK, "cases", "does-not-exist")
    expect_fail(gen_args(d), [d], rc=1)


@case
def gen_model_is_a_file():
    d = os.path.join(H.GOOD, "config.json")
    expect_fail(gen_args(d), [d], rc=1)


@case
def gen_model_config_only():
    d = copy_good("gen_model_config_only", weights=False)
    expect_fail(gen_args(d), [d, "safetensors"], rc=1)


@case
def gen_dump_logits_missing_dir():
    target = os.path.join(H.WORK, "cases", "no-such-dir", "logits.npy")
    expect_fail(gen_args(H.GOOD, "--dump-logits", target), ["cannot create", "no-such-dir"], rc=1)


@case
def gen_dump_logits_disk_full():
    # the write error itself (ENOSPC) must reach the user
    if not os.path.exists("/dev/full"):
        return
    expect_fail(gen_args(H.GOOD, "--dump-logits", "/dev/full"),
                ["/dev/full", os.strerror(28)], rc=1)


@case
def gen_stdout_disk_full():
    # tokens that could not be printed are a failure, not exit 0
    if not os.path.exists("/dev/full"):
        return
    with open("/dev/full", "wb") as full:
        expect_fail(gen_args(H.GOOD), [], rc=(1, 2), report=False, stdout=full)


@case
def gen_model_empty_string():
    expect_fail(gen_args(""), [], rc=(1, 2))


@case
def gen_builtin_cache_dir_is_a_file():
    # no --model: the built-in tiny model cannot be synthesized into the cache
    f = os.path.join(H.WORK, "cases", "cache_is_a_file")
    os.makedirs(os.path.dirname(f), exist_ok=True)
    with open(f, "w") as fh:
        fh.write("not a folder\n")
    expect_fail(gen_args(None), [f], rc=1, env={"M3_CACHE_DIR": f})


@case
def gen_dump_logits_into_directory():
    d = case_dir("gen_dump_logits_into_directory")
    expect_fail(gen_args(H.GOOD, "--dump-logits", d), [d], rc=1)


# ------------------------------------------------------------------ synth arguments

def synth_out(name):
    d = os.path.join(H.WORK, "cases", name)
    if os.path.lexists(d):
        shutil.rmtree(d)
    os.makedirs(os.path.dirname(d), exist_ok=True)
    return d


@case
def synth_unknown_preset():
    expect_fail(["synth", "--preset", "huge", "--out", synth_out("synth_unknown_preset")],
                ["unknown preset 'huge'"], rc=(1, 2))


@case
def synth_layers_zero():
    expect_fail(["synth", "--preset", "tiny", "--layers", "0", "--out",
                 synth_out("synth_layers_zero")], ["--layers = 0 is out of range"], rc=2)


@case
def synth_layers_huge():
    expect_fail(["synth", "--preset", "tiny", "--layers", "9999", "--out",
                 synth_out("synth_layers_huge")], ["--layers = 9999 is out of range"], rc=2)


@case
def synth_layers_more_than_model():
    expect_fail(["synth", "--preset", "tiny", "--layers", "5", "--out",
                 synth_out("synth_layers_more_than_model")], ["layers = 5", "[1, 3]"],
                rc=(1, 2))


@case
def synth_layers_garbage():
    expect_fail(["synth", "--preset", "tiny", "--layers", "three", "--out",
                 synth_out("synth_layers_garbage")], ["--layers expects an integer"], rc=2)


@case
def synth_seed_negative():
    expect_fail(["synth", "--preset", "tiny", "--seed", "-4", "--out",
                 synth_out("synth_seed_negative")], ["--seed = -4 is out of range"], rc=2)


@case
def synth_config_missing():
    missing = os.path.join(H.WORK, "cases", "nope", "config.json")
    expect_fail(["synth", "--config", missing, "--out", synth_out("synth_config_missing")],
                [missing], rc=1)


@case
def synth_config_invalid():
    d = with_config("synth_config_invalid_src", _del_text("hidden_size"))
    expect_fail(["synth", "--config", os.path.join(d, "config.json"), "--out",
                 synth_out("synth_config_invalid")],
                ["missing required field 'hidden_size'"], rc=1)


@case
def synth_preset_and_config():
    expect_fail(["synth", "--preset", "tiny", "--config", os.path.join(H.GOOD, "config.json"),
                 "--out", synth_out("synth_preset_and_config")],
                ["exactly one of --preset or --config"], rc=2)


@case
def synth_neither_preset_nor_config():
    expect_fail(["synth", "--out", synth_out("synth_neither")],
                ["exactly one of --preset or --config"], rc=2)


@case
def synth_no_out():
    expect_fail(["synth", "--preset", "tiny"], ["--out"], rc=2)


@case
def synth_out_missing_value():
    expect_fail(["synth", "--preset", "tiny", "--out"], ["--out needs a value"], rc=2)


@case
def synth_unknown_option():
    expect_fail(["synth", "--preset", "tiny", "--bogus", "1", "--out",
                 synth_out("synth_unknown_option")], ["unknown option '--bogus'"], rc=2)


@case
def synth_out_under_regular_file():
    f = os.path.join(H.WORK, "cases", "synth_out_under_regular_file.txt")
    os.makedirs(os.path.dirname(f), exist_ok=True)
    with open(f, "w") as fh:
        fh.write("not a folder\n")
    out = os.path.join(f, "ckpt")
    expect_fail(["synth", "--preset", "tiny", "--out", out], [out], rc=1)


@case
def synth_out_empty_string():
    expect_fail(["synth", "--preset", "tiny", "--out", ""], ["m3 synth"], rc=(1, 2))


@case
def synth_out_is_regular_file():
    f = os.path.join(H.WORK, "cases", "synth_out_is_regular_file.txt")
    os.makedirs(os.path.dirname(f), exist_ok=True)
    with open(f, "w") as fh:
        fh.write("not a folder\n")
    expect_fail(["synth", "--preset", "tiny", "--out", f], [f], rc=1)


@case
def synth_out_read_only_dir():
    if os.geteuid() == 0:
        return  # root writes anywhere; nothing to test
    parent = os.path.join(H.WORK, "cases", "synth_ro")
    if os.path.lexists(parent):
        os.chmod(parent, 0o755)
        shutil.rmtree(parent)
    os.makedirs(parent)
    os.chmod(parent, stat.S_IRUSR | stat.S_IXUSR)
    try:
        out = os.path.join(parent, "ckpt")
        expect_fail(["synth", "--preset", "tiny", "--out", out], [out], rc=1)
    finally:
        os.chmod(parent, 0o755)


# ------------------------------------------------------------------ speculative decoding

@case
def gen_dump_draft_logits_without_draft():
    expect_fail(gen_args(H.GOOD, "--dump-draft-logits", os.path.join(H.WORK, "x.npy")),
                ["--dump-draft-logits needs --draft"], rc=2)


@case
def gen_draft_missing_folder():
    missing = os.path.join(H.WORK, "cases", "no_drafter_here")
    expect_fail(gen_args(H.GOOD, "--draft", missing), [missing, "config.json"], rc=1)


@case
def gen_draft_not_a_drafter():
    # a target checkpoint is not a drafter: no DSpark keys in its config
    expect_fail(gen_args(H.GOOD, "--draft", H.GOOD), ["not a DSpark drafter"], rc=1)


@case
def gen_draft_batch_dump_draft_logits():
    d = synth_out("gen_draft_batch_dump_draft_logits")
    run_m3(["synth", "--draft-for", H.GOOD, "--out", d, "--layers", "1"])
    expect_fail(gen_args(H.GOOD, "--prompt", "hi", "--draft", d, "--dump-draft-logits",
                         os.path.join(H.WORK, "x.npy")),
                ["--dump-draft-logits takes one prompt"], rc=2)


@case
def gen_draft_max_rows_too_small():
    d = synth_out("gen_draft_max_rows_too_small")
    run_m3(["synth", "--draft-for", H.GOOD, "--out", d, "--layers", "1"])
    expect_fail(gen_args(H.GOOD, "--draft", d, "--max-rows", "4"), ["max_rows is 4"], rc=1)


@case
def synth_draft_block_without_draft_for():
    expect_fail(["synth", "--preset", "tiny", "--draft-block", "3", "--out",
                 synth_out("synth_draft_block_without_draft_for")],
                ["--draft-block and --draft-window need --draft-for"], rc=2)


@case
def synth_draft_block_out_of_range():
    expect_fail(["synth", "--draft-for", H.GOOD, "--draft-block", "16", "--out",
                 synth_out("synth_draft_block_out_of_range")], ["--draft-block", "16"], rc=2)


@case
def synth_draft_window_below_block():
    expect_fail(["synth", "--draft-for", H.GOOD, "--draft-window", "3", "--out",
                 synth_out("synth_draft_window_below_block")],
                ["window of 3 keys is smaller than the block of 7"], rc=1)


@case
def synth_draft_for_missing_target():
    missing = os.path.join(H.WORK, "cases", "no_target_here")
    expect_fail(["synth", "--draft-for", missing, "--out",
                 synth_out("synth_draft_for_missing_target")], [missing], rc=1)


# ================================================================== main


if __name__ == "__main__":
    sys.exit(main("test_bad_args"))
