#!/usr/bin/env python3
"""Bad-input tests for the `m3` command-line program.

Every case feeds `m3` one broken thing -- a config.json, a safetensors file,
a checkpoint folder, a command-line argument -- and checks that the program
refuses it the way the CLI promises:

  * the exit status is the expected failure code (1 for a runtime failure,
    2 for a usage error): never 0, never a signal, never a hang (each run
    has a 60 s limit);
  * stderr names the problem (the field, the tensor, the value: every case
    lists the substrings it needs);
  * a runtime failure is reported as "m3 <cmd>: M3_ERR_<...>: <message>";
  * stderr holds no sanitizer or crash report (the test also runs against
    the AddressSanitizer + UBSan build).

One positive control (the untouched checkpoint generates, exit 0) makes sure
the harness can tell success from failure.

Usage: test_bad_input.py --m3 PATH_TO_M3 --work SCRATCH_DIR [-k SUBSTRING] [-v]
Python 3 standard library only (numpy is not needed).
"""
import argparse
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import time

TIMEOUT_S = 60
BAD_MARKERS = ("Sanitizer", "runtime error", "Segmentation", "Assertion", "core dumped",
               "stack-overflow", "Aborted")
REPORT_RE = re.compile(r"^m3 (generate|synth|bench): M3_ERR_[A-Z_]+: \S", re.M)
PREFIX = "language_model.model."
ST_NAME = "model.safetensors"

M3 = None
WORK = None
GOOD = None
VERBOSE = False
ENV = None


# ------------------------------------------------------------------ running

class Case:
    def __init__(self, name, fn):
        self.name = name
        self.fn = fn


CASES = []


def case(fn):
    CASES.append(Case(fn.__name__, fn))
    return fn


class Failure(Exception):
    pass


def run_m3(args, timeout=TIMEOUT_S, env=None, stdout=subprocess.PIPE):
    cmd = [M3] + [str(a) for a in args]
    t0 = time.monotonic()
    full_env = dict(ENV, **(env or {}))
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=stdout,
                           stderr=subprocess.PIPE, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired as e:
        err = (e.stderr or b"").decode("utf-8", "replace")
        raise Failure(f"HANG: no exit within {timeout} s\n  command: {shell(cmd)}\n"
                      f"  stderr so far: {err[-2000:]}")
    dt = time.monotonic() - t0
    out = (p.stdout or b"").decode("utf-8", "replace")
    err = p.stderr.decode("utf-8", "replace")
    return p.returncode, out, err, cmd, dt


def shell(cmd):
    return " ".join(a if re.fullmatch(r"[\w@%+=:,./-]*", a) and a else repr(a) for a in cmd)


def expect_fail(args, want, rc=(1, 2), absent=(), report=True, **run_kw):
    """Run m3 with args; it must fail with an exit code in rc and a stderr
    holding every string in want (case-sensitive) and none in absent. With
    report, an exit 1 must come with the "m3 <cmd>: M3_ERR_...:" line."""
    if isinstance(rc, int):
        rc = (rc,)
    if isinstance(want, str):
        want = (want,)
    code, out, err, cmd, dt = run_m3(args, **run_kw)
    problems = []
    if code < 0:
        problems.append(f"killed by signal {-code}")
    elif code == 0:
        problems.append("exit 0: the bad input was accepted")
    elif code == 124:
        problems.append("exit 124 (timeout)")
    elif code not in rc:
        problems.append(f"exit {code}, expected {' or '.join(map(str, rc))}")
    for m in BAD_MARKERS:
        if m in err:
            problems.append(f"stderr holds a crash/sanitizer report ({m!r})")
    for w in want:
        if w not in err:
            problems.append(f"stderr lacks {w!r}")
    for a in absent:
        if a in err:
            problems.append(f"stderr holds {a!r}")
    if report and code == 1 and not REPORT_RE.search(err):
        problems.append("exit 1 but no 'm3 <cmd>: M3_ERR_<...>: <message>' line on stderr")
    if problems:
        out_to = run_kw.get("stdout")
        where = f" > {out_to.name}" if hasattr(out_to, "name") else ""
        raise Failure("; ".join(problems) + f"\n  command: {shell(cmd)}{where}\n  exit: {code}\n"
                      f"  stderr: {err.strip()[:3000]}")
    if VERBOSE:
        print(f"    [{dt:.2f}s] exit {code}: {err.strip().splitlines()[-1] if err.strip() else ''}")
    return err


def gen_args(model, *extra, ids="1,2,3", max_tokens=2):
    a = ["generate"]
    if model is not None:
        a += ["--model", model]
    if ids is not None:
        a += ["--prompt-ids", ids]
    if max_tokens is not None:
        a += ["--max-tokens", str(max_tokens)]
    return a + list(extra)


def expect_gen_fail(model, want, rc=1, **kw):
    return expect_fail(gen_args(model, **kw), want, rc)


# ------------------------------------------------------------------ checkpoints

def case_dir(name):
    d = os.path.join(WORK, "cases", name)
    if os.path.lexists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    return d


def copy_good(name, weights=True):
    """A fresh copy of the good checkpoint (config.json and, when weights,
    model.safetensors) in its own folder."""
    d = case_dir(name)
    shutil.copyfile(os.path.join(GOOD, "config.json"), os.path.join(d, "config.json"))
    if weights:
        shutil.copyfile(os.path.join(GOOD, ST_NAME), os.path.join(d, ST_NAME))
    return d


def load_config():
    with open(os.path.join(GOOD, "config.json")) as f:
        return json.load(f)


def with_config(name, mutate=None, text=None):
    """The good checkpoint with config.json replaced by mutate(cfg) (which
    edits the parsed JSON in place) or by the raw text."""
    d = copy_good(name)
    path = os.path.join(d, "config.json")
    if text is None:
        cfg = load_config()
        mutate(cfg)
        text = json.dumps(cfg, indent=1)
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(path, mode) as f:
        f.write(text)
    return d


class St:
    """A parsed safetensors file: header entries in file order (a list of
    [name, dict] pairs, so duplicate names survive) and the data section."""

    def __init__(self, path):
        with open(path, "rb") as f:
            raw = f.read()
        (n,) = struct.unpack("<Q", raw[:8])
        self.items = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=list)
        self.items = [[k, dict(v) if isinstance(v, list) else v] for k, v in self.items]
        self.data = raw[8 + n:]

    def get(self, name):
        for k, v in self.items:
            if k == name:
                return v
        raise KeyError(name)

    def remove(self, name):
        before = len(self.items)
        self.items = [kv for kv in self.items if kv[0] != name]
        assert len(self.items) == before - 1, name

    def rename(self, old, new):
        for kv in self.items:
            if kv[0] == old:
                kv[0] = new
                return
        raise KeyError(old)

    def header_bytes(self):
        body = "{" + ",".join(json.dumps(k) + ":" + json.dumps(v) for k, v in self.items) + "}"
        b = body.encode("utf-8")
        pad = (-(8 + len(b))) % 64
        return b + b" " * pad

    def write(self, path, header=None, length=None, data=None):
        h = self.header_bytes() if header is None else header
        n = len(h) if length is None else length
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", n))
            f.write(h)
            f.write(self.data if data is None else data)


def good_st():
    return St(os.path.join(GOOD, ST_NAME))


def with_st(name, mutate, **write_kw):
    """The good checkpoint with model.safetensors rewritten after
    mutate(st) edits the header entries."""
    d = copy_good(name, weights=False)
    st = good_st()
    mutate(st)
    st.write(os.path.join(d, ST_NAME), **write_kw)
    return d


def with_st_bytes(name, raw):
    d = copy_good(name, weights=False)
    with open(os.path.join(d, ST_NAME), "wb") as f:
        f.write(raw)
    return d


def good_bytes():
    with open(os.path.join(GOOD, ST_NAME), "rb") as f:
        return f.read()


# ================================================================== cases

# ------------------------------------------------------------------ control

@case
def control_good_checkpoint_generates():
    code, out, err, cmd, dt = run_m3(gen_args(GOOD))
    bad = [m for m in BAD_MARKERS if m in err]
    if code != 0 or bad or not out.startswith("tokens:") or not 2 <= len(out.split()) <= 3:
        raise Failure(f"the good checkpoint does not generate cleanly: exit {code}\n"
                      f"  command: {shell(cmd)}\n  stdout: {out.strip()}\n  stderr: {err.strip()}")


@case
def control_harness_rejects_success():
    # expect_fail must itself fail when m3 succeeds
    try:
        expect_fail(gen_args(GOOD), "anything")
    except Failure:
        return
    raise Failure("expect_fail accepted a successful run")


# ------------------------------------------------------------------ config.json

@case
def config_missing_file():
    d = copy_good("config_missing_file")
    os.remove(os.path.join(d, "config.json"))
    expect_gen_fail(d, ["M3_ERR_IO", "config.json"])


@case
def config_not_json():
    d = with_config("config_not_json", text='{"text_config": {"hidden_size": 256,, }')
    expect_gen_fail(d, ["config.json", "not valid JSON"])


@case
def config_empty_file():
    d = with_config("config_empty_file", text="")
    expect_gen_fail(d, ["config.json", "not valid JSON"])


@case
def config_binary_garbage():
    d = with_config("config_binary_garbage", text=bytes(range(256)) * 4)
    expect_gen_fail(d, ["config.json", "not valid JSON"])


@case
def config_deeply_nested():
    # must be refused, not recurse until the stack runs out
    d = with_config("config_deeply_nested", text="[" * 200000 + "]" * 200000)
    expect_gen_fail(d, ["config.json"])


@case
def config_top_level_list():
    d = with_config("config_top_level_list", text=json.dumps([load_config()]))
    expect_gen_fail(d, ["config.json", "top level must be an object"])


@case
def config_text_config_not_object():
    d = with_config("config_text_config_not_object",
                    mutate=lambda c: c.__setitem__("text_config", [1, 2]))
    expect_gen_fail(d, ["'text_config' must be an object"])


def _del_text(field):
    return lambda c: c["text_config"].pop(field)


def _del_sparse(field):
    return lambda c: c["text_config"]["sparse_attention_config"].pop(field)


def _set_text(field, value):
    return lambda c: c["text_config"].__setitem__(field, value)


def _set_sparse(field, value):
    return lambda c: c["text_config"]["sparse_attention_config"].__setitem__(field, value)


@case
def config_missing_hidden_size():
    d = with_config("config_missing_hidden_size", _del_text("hidden_size"))
    expect_gen_fail(d, ["missing required field 'hidden_size'", "M3_ERR_CONFIG"])


@case
def config_missing_vocab_size():
    d = with_config("config_missing_vocab_size", _del_text("vocab_size"))
    expect_gen_fail(d, ["missing required field 'vocab_size'"])


@case
def config_missing_num_attention_heads():
    d = with_config("config_missing_num_attention_heads", _del_text("num_attention_heads"))
    expect_gen_fail(d, ["missing required field 'num_attention_heads'"])


@case
def config_missing_num_hidden_layers():
    d = with_config("config_missing_num_hidden_layers", _del_text("num_hidden_layers"))
    expect_gen_fail(d, ["missing required field 'num_hidden_layers'"])


@case
def config_missing_num_local_experts():
    d = with_config("config_missing_num_local_experts", _del_text("num_local_experts"))
    expect_gen_fail(d, ["missing required field 'num_local_experts'"])


@case
def config_missing_sparse_topk_blocks():
    d = with_config("config_missing_sparse_topk_blocks", _del_sparse("sparse_topk_blocks"))
    expect_gen_fail(d, ["missing required field 'sparse_topk_blocks'"])


@case
def config_wrong_type_hidden_size_string():
    d = with_config("config_wrong_type_hidden_size_string", _set_text("hidden_size", "256"))
    expect_gen_fail(d, ["'hidden_size' must be an integer"])


@case
def config_wrong_type_hidden_size_fraction():
    d = with_config("config_wrong_type_hidden_size_fraction", _set_text("hidden_size", 256.5))
    expect_gen_fail(d, ["'hidden_size' must be an integer"])


@case
def config_wrong_type_bool_field():
    d = with_config("config_wrong_type_bool_field", _set_text("use_routing_bias", "yes"))
    expect_gen_fail(d, ["'use_routing_bias' must be true or false"])


@case
def config_wrong_type_moe_layer_freq():
    d = with_config("config_wrong_type_moe_layer_freq", _set_text("moe_layer_freq", "0,1,1"))
    expect_gen_fail(d, ["'moe_layer_freq' must be a list"])


@case
def config_wrong_type_sparse_config():
    d = with_config("config_wrong_type_sparse_config",
                    _set_text("sparse_attention_config", 128))
    expect_gen_fail(d, ["'sparse_attention_config' must be an object"])


@case
def config_out_of_range_heads_zero():
    d = with_config("config_out_of_range_heads_zero", _set_text("num_attention_heads", 0))
    expect_gen_fail(d, ["num_attention_heads = 0 is out of range"])


@case
def config_out_of_range_hidden_size_huge():
    d = with_config("config_out_of_range_hidden_size_huge", _set_text("hidden_size", 10 ** 12))
    expect_gen_fail(d, ["hidden_size = 1000000000000 is out of range"])


@case
def config_out_of_range_vocab_negative():
    d = with_config("config_out_of_range_vocab_negative", _set_text("vocab_size", -5))
    expect_gen_fail(d, ["vocab_size = -5 is out of range"])


@case
def config_out_of_range_layers():
    d = with_config("config_out_of_range_layers", _set_text("num_hidden_layers", 100000))
    expect_gen_fail(d, ["num_hidden_layers = 100000 is out of range"])


@case
def config_out_of_range_number_beyond_double():
    # 1e400 is not a finite double; JSON parsers may turn it into inf
    d = with_config("config_out_of_range_number_beyond_double",
                    text=json.dumps(load_config()).replace('"hidden_size": 256',
                                                           '"hidden_size": 1e400'))
    expect_gen_fail(d, ["hidden_size"])


@case
def config_out_of_range_max_position_zero():
    d = with_config("config_out_of_range_max_position_zero",
                    _set_text("max_position_embeddings", 0))
    expect_gen_fail(d, ["max_position_embeddings = 0 is out of range"])


@case
def config_sparse_block_size_64():
    d = with_config("config_sparse_block_size_64", _set_sparse("sparse_block_size", 64))
    expect_gen_fail(d, ["sparse_block_size = 64 is not supported", "M3_ERR_UNSUPPORTED"])


@case
def config_moe_layer_freq_wrong_length():
    d = with_config("config_moe_layer_freq_wrong_length", _set_text("moe_layer_freq", [0, 1]))
    expect_gen_fail(d, ["'moe_layer_freq' has 2 entries for 3 layers"])


@case
def config_moe_layer_freq_bad_entry():
    d = with_config("config_moe_layer_freq_bad_entry", _set_text("moe_layer_freq", [0, 2, 1]))
    expect_gen_fail(d, ["moe_layer_freq[1] must be 0 or 1"])


@case
def config_sparse_freq_wrong_length():
    d = with_config("config_sparse_freq_wrong_length",
                    _set_sparse("sparse_attention_freq", [0, 1, 1, 1]))
    expect_gen_fail(d, ["'sparse_attention_freq' has 4 entries for 3 layers"])


@case
def config_heads_not_multiple_of_kv():
    d = with_config("config_heads_not_multiple_of_kv", _set_text("num_key_value_heads", 3))
    expect_gen_fail(d, ["num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"])


@case
def config_experts_per_tok_exceeds_experts():
    d = with_config("config_experts_per_tok_exceeds_experts",
                    _set_text("num_experts_per_tok", 9))
    expect_gen_fail(d, ["num_experts_per_tok = 9 exceeds num_local_experts = 8"])


@case
def config_unsupported_activation():
    d = with_config("config_unsupported_activation", _set_text("hidden_act", "gelu"))
    expect_gen_fail(d, ["hidden_act = gelu is not supported"])


@case
def config_unsupported_model_type():
    d = with_config("config_unsupported_model_type", _set_text("model_type", "llama"))
    expect_gen_fail(d, ["model_type = llama is not MiniMax-M3"])


@case
def config_eos_outside_vocab():
    d = with_config("config_eos_outside_vocab", _set_text("eos_token_id", 512))
    expect_gen_fail(d, ["eos_token_id = 512 is outside the vocab 512"])


@case
def config_unsupported_quantization():
    d = with_config("config_unsupported_quantization",
                    lambda c: c.__setitem__("quantization_config", {"quant_method": "gptq"}))
    expect_gen_fail(d, ["quant_method = gptq is not supported"])


@case
def config_hidden_size_disagrees_with_checkpoint():
    # a valid config that does not describe these weights: the first bound
    # tensor's shape is named
    d = with_config("config_hidden_size_disagrees_with_checkpoint", _set_text("hidden_size", 128))
    expect_gen_fail(d, [PREFIX + "embed_tokens.weight has shape [512, 256]; expected [512, 128]"])


@case
def config_vocab_disagrees_with_checkpoint():
    d = with_config("config_vocab_disagrees_with_checkpoint", _set_text("vocab_size", 1024))
    expect_gen_fail(d, [PREFIX + "embed_tokens.weight has shape [512, 256]; expected [1024, 256]"])


@case
def config_experts_disagree_with_checkpoint():
    d = with_config("config_experts_disagree_with_checkpoint", _set_text("num_local_experts", 16))
    expect_gen_fail(d, [PREFIX + "layers.1.block_sparse_moe.gate.weight has shape [8, 256]; "
                        "expected [16, 256]"])


@case
def config_is_a_directory():
    d = copy_good("config_is_a_directory")
    os.remove(os.path.join(d, "config.json"))
    os.mkdir(os.path.join(d, "config.json"))
    expect_gen_fail(d, ["config.json"])


# ------------------------------------------------------------------ safetensors

@case
def st_truncated_in_data():
    raw = good_bytes()
    d = with_st_bytes("st_truncated_in_data", raw[:len(raw) - 1000])
    # the last tensor in the file now ends past the data section
    expect_gen_fail(d, ["language_model.lm_head.weight", "outside the data section"])


@case
def st_truncated_in_header():
    raw = good_bytes()
    d = with_st_bytes("st_truncated_in_header", raw[:8 + 100])
    expect_gen_fail(d, [ST_NAME, "runs past the end of the file"])


@case
def st_truncated_in_length_prefix():
    d = with_st_bytes("st_truncated_in_length_prefix", good_bytes()[:5])
    expect_gen_fail(d, [ST_NAME, "truncated (5 bytes"])


@case
def st_empty_file():
    d = with_st_bytes("st_empty_file", b"")
    expect_gen_fail(d, [ST_NAME, "truncated (0 bytes"])


@case
def st_header_length_past_eof():
    raw = good_bytes()
    d = with_st_bytes("st_header_length_past_eof", struct.pack("<Q", len(raw)) + raw[8:])
    expect_gen_fail(d, [f"header length {len(raw)} runs past the end of the file"])


@case
def st_header_length_huge():
    raw = good_bytes()
    d = with_st_bytes("st_header_length_huge", struct.pack("<Q", 2 ** 64 - 1) + raw[8:])
    expect_gen_fail(d, [f"header length {2 ** 64 - 1} is over the 100 MiB limit"])


@case
def st_header_length_zero():
    raw = good_bytes()
    d = with_st_bytes("st_header_length_zero", struct.pack("<Q", 0) + raw[8:])
    expect_gen_fail(d, [ST_NAME, "header is not valid JSON"])


@case
def st_header_not_json():
    st = good_st()
    h = st.header_bytes()
    bad = b"this is not json" + b" " * (len(h) - 16)
    d = with_st("st_header_not_json", lambda s: None, header=bad)
    expect_gen_fail(d, [ST_NAME, "header is not valid JSON"])


@case
def st_header_trailing_garbage():
    st = good_st()
    h = st.header_bytes().rstrip(b" ") + b"xx"
    d = with_st("st_header_trailing_garbage", lambda s: None, header=h)
    expect_gen_fail(d, [ST_NAME, "header is not valid JSON"])


@case
def st_header_json_list():
    d = with_st("st_header_json_list", lambda s: None, header=b"[1, 2, 3]" + b" " * 47)
    expect_gen_fail(d, [ST_NAME, "header is JSON but not an object"])


@case
def st_header_nul_byte():
    h = good_st().header_bytes()
    h = h[:-1] + b"\0"
    d = with_st("st_header_nul_byte", lambda s: None, header=h)
    expect_gen_fail(d, [ST_NAME, "NUL byte"])


@case
def st_header_empty_object():
    d = with_st("st_header_empty_object", lambda s: None, header=b"{}" + b" " * 54)
    expect_gen_fail(d, ["checkpoint has no embedding"])


@case
def st_header_metadata_only():
    # a well-formed file that holds no tensors
    d = with_st("st_header_metadata_only",
                lambda st: setattr(st, "items", [kv for kv in st.items if kv[0] == "__metadata__"]))
    expect_gen_fail(d, ["checkpoint has no embedding"])


@case
def st_overlapping_offsets():
    a, b = PREFIX + "layers.0.self_attn.q_norm.weight", PREFIX + "layers.0.self_attn.k_norm.weight"

    def m(st):
        st.get(b)["data_offsets"] = list(st.get(a)["data_offsets"])
    d = with_st("st_overlapping_offsets", m)
    expect_gen_fail(d, ["overlap", "q_norm.weight", "k_norm.weight"])


@case
def st_partially_overlapping_offsets():
    name = PREFIX + "layers.0.self_attn.k_norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["data_offsets"] = [b - 2, e - 2]
    d = with_st("st_partially_overlapping_offsets", m)
    expect_gen_fail(d, ["overlap", "k_norm.weight"])


@case
def st_offsets_past_end():
    name = PREFIX + "norm.weight"
    n = len(good_st().data)

    def m(st):
        st.get(name)["data_offsets"] = [n, n + 512]
    d = with_st("st_offsets_past_end", m)
    expect_gen_fail(d, [name, f"data_offsets [{n}, {n + 512}] outside the data section"])


@case
def st_offsets_reversed():
    name = PREFIX + "norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["data_offsets"] = [e, b]
    d = with_st("st_offsets_reversed", m)
    expect_gen_fail(d, [name, "data_offsets"])


@case
def st_offsets_not_integers():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["data_offsets"] = [0.5, "x"]
    d = with_st("st_offsets_not_integers", m)
    expect_gen_fail(d, [name, "is not [begin, end] of non-negative integers"])


@case
def st_offsets_beyond_2_53():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["data_offsets"] = [2 ** 64 - 512, 2 ** 64]
    d = with_st("st_offsets_beyond_2_53", m)
    expect_gen_fail(d, [name, "data_offsets"])


@case
def st_size_mismatch():
    name = PREFIX + "norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["data_offsets"] = [b, e - 2]
    d = with_st("st_size_mismatch", m)
    expect_gen_fail(d, [name, "span 510 bytes but shape [256] of BF16 needs 512"])


@case
def st_shape_negative():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = [-256]
    d = with_st("st_shape_negative", m)
    expect_gen_fail(d, [name, "shape[0] is -256"])


@case
def st_shape_overflow():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = [2 ** 40, 2 ** 40]
    d = with_st("st_shape_overflow", m)
    expect_gen_fail(d, [name, "too many elements"])


@case
def st_shape_too_many_dims():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = [1] * 8 + [256]
    d = with_st("st_shape_too_many_dims", m)
    expect_gen_fail(d, [name, "shape has 9 dims"])


@case
def st_shape_not_a_list():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["shape"] = 256
    d = with_st("st_shape_not_a_list", m)
    expect_gen_fail(d, [name, "is not an array"])


@case
def st_entry_missing_key():
    name = PREFIX + "norm.weight"

    def m(st):
        del st.get(name)["dtype"]
    d = with_st("st_entry_missing_key", m)
    expect_gen_fail(d, [name, "missing key 'dtype'"])


@case
def st_entry_unknown_key():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["stride"] = [1]
    d = with_st("st_entry_unknown_key", m)
    expect_gen_fail(d, [name, "unknown key 'stride'"])


@case
def st_entry_not_object():
    name = PREFIX + "norm.weight"

    def m(st):
        for kv in st.items:
            if kv[0] == name:
                kv[1] = "BF16"
    d = with_st("st_entry_not_object", m)
    expect_gen_fail(d, [name, "is not an object"])


@case
def st_metadata_not_strings():
    def m(st):
        st.get("__metadata__")["format"] = 7
    d = with_st("st_metadata_not_strings", m)
    expect_gen_fail(d, ["__metadata__ value 'format'"])


@case
def st_duplicate_tensor_name():
    name = PREFIX + "norm.weight"

    def m(st):
        st.items.append([name, dict(st.get(name))])
    d = with_st("st_duplicate_tensor_name", m)
    expect_gen_fail(d, [name])


# (the same name twice with the same offsets is reported as the tensor
# overlapping itself; the name is all this case requires)


@case
def st_duplicate_tensor_name_other_data():
    # the same name twice, pointing at different bytes
    name = PREFIX + "norm.weight"
    other = PREFIX + "layers.0.input_layernorm.weight"

    def m(st):
        st.items.append([name, dict(st.get(other))])
        st.remove(other)
    d = with_st("st_duplicate_tensor_name_other_data", m)
    expect_gen_fail(d, [f"duplicate tensor name '{name}'"])


@case
def st_unknown_dtype():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["dtype"] = "BF17"
    d = with_st("st_unknown_dtype", m)
    expect_gen_fail(d, [name, "unknown dtype \"BF17\""])


@case
def st_dtype_not_a_string():
    name = PREFIX + "norm.weight"

    def m(st):
        st.get(name)["dtype"] = 16
    d = with_st("st_dtype_not_a_string", m)
    expect_gen_fail(d, [name, "unknown dtype 16"])


@case
def st_missing_index_k_proj():
    name = PREFIX + "layers.1.self_attn.index_k_proj.weight"
    d = with_st("st_missing_index_k_proj", lambda st: st.remove(name))
    expect_gen_fail(d, [f"checkpoint is missing tensor {name}"])


@case
def st_missing_expert():
    name = PREFIX + "layers.2.block_sparse_moe.experts.7.w2.weight"
    d = with_st("st_missing_expert", lambda st: st.remove(name))
    expect_gen_fail(d, [f"checkpoint is missing tensor {name}"])


@case
def st_missing_lm_head():
    d = with_st("st_missing_lm_head", lambda st: st.remove("language_model.lm_head.weight"))
    expect_gen_fail(d, ["checkpoint has no lm_head"])


@case
def st_missing_embedding():
    d = with_st("st_missing_embedding",
                lambda st: st.rename(PREFIX + "embed_tokens.weight", "embed.weight"))
    expect_gen_fail(d, ["checkpoint has no embedding"])


@case
def st_missing_routing_bias():
    name = PREFIX + "layers.1.block_sparse_moe.e_score_correction_bias"
    d = with_st("st_missing_routing_bias", lambda st: st.remove(name))
    expect_gen_fail(d, [f"checkpoint is missing tensor {name}"])


@case
def st_wrong_shape_transposed():
    # same bytes, transposed: only the shape is wrong for the model
    name = PREFIX + "layers.0.self_attn.q_proj.weight"

    def m(st):
        assert st.get(name)["shape"] == [512, 256]
        st.get(name)["shape"] = [256, 512]
    d = with_st("st_wrong_shape_transposed", m)
    expect_gen_fail(d, [f"tensor {name} has shape [256, 512]; expected [512, 256]"])


@case
def st_wrong_shape_smaller():
    name = PREFIX + "norm.weight"

    def m(st):
        b, e = st.get(name)["data_offsets"]
        st.get(name)["shape"] = [128]
        st.get(name)["data_offsets"] = [b, b + 256]
    d = with_st("st_wrong_shape_smaller", m)
    expect_gen_fail(d, [f"tensor {name} has shape [128]; expected [256]"])


@case
def st_wrong_shape_extra_dim():
    name = PREFIX + "layers.0.input_layernorm.weight"

    def m(st):
        st.get(name)["shape"] = [1, 256]
    d = with_st("st_wrong_shape_extra_dim", m)
    expect_gen_fail(d, [f"tensor {name} has shape [1, 256]; expected [256]"])


@case
def st_wrong_dtype_norm_f16():
    name = PREFIX + "layers.0.input_layernorm.weight"

    def m(st):
        assert st.get(name)["dtype"] == "BF16"
        st.get(name)["dtype"] = "F16"
    d = with_st("st_wrong_dtype_norm_f16", m)
    expect_gen_fail(d, [f"tensor {name} has dtype F16; expected BF16"])


@case
def st_wrong_dtype_linear_f16():
    name = PREFIX + "layers.2.self_attn.o_proj.weight"

    def m(st):
        st.get(name)["dtype"] = "F16"
    d = with_st("st_wrong_dtype_linear_f16", m)
    expect_gen_fail(d, [f"tensor {name} has dtype F16"])


@case
def st_router_bf16():
    name = PREFIX + "layers.1.block_sparse_moe.gate.weight"

    def m(st):
        e = st.get(name)
        assert e["dtype"] == "F32" and e["shape"] == [8, 256]
        b, _ = e["data_offsets"]
        e["dtype"] = "BF16"
        e["data_offsets"] = [b, b + 8 * 256 * 2]
    d = with_st("st_router_bf16", m)
    expect_gen_fail(d, [f"tensor {name} has dtype BF16; expected F32"])


@case
def st_fp8_weight_without_scale():
    # an F8_E4M3 (MXFP8) weight needs its weight_scale_inv companion
    name = PREFIX + "layers.0.self_attn.q_proj.weight"

    def m(st):
        e = st.get(name)
        b, _ = e["data_offsets"]
        e["dtype"] = "F8_E4M3"
        e["data_offsets"] = [b, b + 512 * 256]
    d = with_st("st_fp8_weight_without_scale", m)
    expect_gen_fail(d, [name, "layers.0.self_attn.q_proj.weight_scale_inv"])


@case
def st_is_a_directory():
    d = copy_good("st_is_a_directory", weights=False)
    os.mkdir(os.path.join(d, ST_NAME))
    expect_gen_fail(d, [ST_NAME, "not a regular file"])


@case
def st_is_a_fifo():
    # a named pipe is not a regular file: it must be refused, not opened and
    # waited on (nothing ever writes to it)
    d = copy_good("st_is_a_fifo", weights=False)
    os.mkfifo(os.path.join(d, ST_NAME))
    expect_fail(gen_args(d), [ST_NAME, "not a regular file"], rc=1, timeout=10)


@case
def st_no_weights_at_all():
    d = copy_good("st_no_weights_at_all", weights=False)
    expect_gen_fail(d, ["no model.safetensors.index.json"])


@case
def st_two_files_no_index():
    d = copy_good("st_two_files_no_index", weights=False)
    for n in ("a.safetensors", "b.safetensors"):
        shutil.copyfile(os.path.join(GOOD, ST_NAME), os.path.join(d, n))
    expect_gen_fail(d, ["holds 2 *.safetensors files", "model.safetensors.index.json"])


def _sharded(name, weight_map_fn, shards):
    """The good weights as shard files plus an index whose weight_map is
    weight_map_fn(list of tensor names)."""
    d = copy_good(name, weights=False)
    for s in shards:
        shutil.copyfile(os.path.join(GOOD, ST_NAME), os.path.join(d, s))
    names = [k for k, _ in good_st().items if k != "__metadata__"]
    index = {"metadata": {}, "weight_map": weight_map_fn(names)}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return d


@case
def st_index_missing_shard():
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    d = _sharded("st_index_missing_shard",
                 lambda names: {n: (s1 if i % 2 else s2) for i, n in enumerate(names)}, [s1])
    expect_gen_fail(d, [s2, "cannot open"])


@case
def st_index_not_json():
    d = copy_good("st_index_not_json")
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write("{ weight_map: ")
    expect_gen_fail(d, ["model.safetensors.index.json", "not a JSON object"])


@case
def st_index_no_weight_map():
    d = copy_good("st_index_no_weight_map")
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}}, f)
    expect_gen_fail(d, ["weight_map", "is not a non-empty object"])


@case
def st_index_path_escape():
    d = _sharded("st_index_path_escape",
                 lambda names: {n: "../good/model.safetensors" for n in names}, [])
    expect_gen_fail(d, ["is not a plain file name in the folder"])


@case
def st_index_wrong_shard():
    # two distinct shards; the index claims one tensor lives in the other
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    d = copy_good("st_index_wrong_shard", weights=False)
    st = good_st()
    names = [k for k, _ in st.items if k != "__metadata__"]
    first, second = names[:len(names) // 2], names[len(names) // 2:]
    for shard, keep in ((s1, first), (s2, second)):
        part = good_st()
        part.items = [kv for kv in part.items if kv[0] == "__metadata__" or kv[0] in keep]
        part.write(os.path.join(d, shard))
    wm = {n: s1 for n in first}
    wm.update({n: s2 for n in second})
    liar = second[0]
    wm[liar] = s1
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wm}, f)
    expect_gen_fail(d, [liar, "which does not hold it"])


@case
def st_index_tensor_in_two_shards():
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    d = _sharded("st_index_tensor_in_two_shards",
                 lambda names: {n: (s1 if i % 2 else s2) for i, n in enumerate(names)}, [s1, s2])
    expect_gen_fail(d, ["appears in two shards"])


# ------------------------------------------------------------------ generate arguments

@case
def gen_token_id_equal_vocab():
    expect_fail(gen_args(GOOD, ids="1,512,3"), ["token id 512", "vocabulary"], rc=1)


@case
def gen_token_id_far_beyond_vocab():
    expect_fail(gen_args(GOOD, ids="2147483647"), ["token id 2147483647"], rc=1)


@case
def gen_token_id_beyond_int32():
    expect_fail(gen_args(GOOD, ids="1,4294967296"), ["--prompt-ids", "bad entry 1"], rc=2)


@case
def gen_token_id_negative():
    expect_fail(gen_args(GOOD, ids="1,-2,3"), ["--prompt-ids", "bad entry 1", "-2"], rc=2)


@case
def gen_prompt_ids_garbage():
    expect_fail(gen_args(GOOD, ids="1,two,3"), ["--prompt-ids", "bad entry 1", "two"], rc=2)


@case
def gen_prompt_ids_empty_entry():
    expect_fail(gen_args(GOOD, ids="1,,3"), ["--prompt-ids", "bad entry 1"], rc=2)


@case
def gen_prompt_ids_trailing_comma():
    expect_fail(gen_args(GOOD, ids="1,2,"), ["--prompt-ids ends with a comma"], rc=2)


@case
def gen_prompt_ids_float():
    expect_fail(gen_args(GOOD, ids="1.5"), ["--prompt-ids", "bad entry 0"], rc=2)


@case
def gen_prompt_ids_empty():
    expect_fail(gen_args(GOOD, ids=""), ["prompt is empty"], rc=(1, 2))


@case
def gen_prompt_text_empty():
    expect_fail(gen_args(GOOD, "--prompt", "", ids=None), ["prompt is empty"], rc=(1, 2))


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
    expect_fail(gen_args(GOOD, max_tokens=-1), ["--max-tokens = -1 is out of range"], rc=2)


@case
def gen_max_tokens_garbage():
    expect_fail(gen_args(GOOD, max_tokens="lots"), ["--max-tokens expects an integer", "lots"],
                rc=2)


@case
def gen_max_tokens_overflow():
    expect_fail(gen_args(GOOD, max_tokens="99999999999999999999999"),
                ["--max-tokens expects an integer"], rc=2)


@case
def gen_max_tokens_missing_value():
    expect_fail(["generate", "--model", GOOD, "--prompt-ids", "1,2,3", "--max-tokens"],
                ["--max-tokens needs a value"], rc=2)


@case
def gen_unknown_option():
    expect_fail(gen_args(GOOD, "--frobnicate", "3"), ["unknown option '--frobnicate'"], rc=2)


@case
def gen_unknown_command():
    expect_fail(["generat", "--model", GOOD], ["unknown command 'generat'"], rc=2)


@case
def gen_no_command():
    expect_fail([], ["usage: m3"], rc=2)


@case
def gen_temperature_negative():
    expect_fail(gen_args(GOOD, "--temperature", "-1"), ["--temperature = -1 is out of range"],
                rc=2)


@case
def gen_temperature_nan():
    expect_fail(gen_args(GOOD, "--temperature", "nan"), ["--temperature expects a number"], rc=2)


@case
def gen_temperature_inf():
    expect_fail(gen_args(GOOD, "--temperature", "inf"), ["--temperature expects a number"], rc=2)


@case
def gen_top_p_zero():
    expect_fail(gen_args(GOOD, "--temperature", "1", "--top-p", "0"),
                ["--top-p = 0 is out of range"], rc=2)


@case
def gen_top_p_above_one():
    expect_fail(gen_args(GOOD, "--temperature", "1", "--top-p", "1.5"),
                ["--top-p = 1.5 is out of range"], rc=2)


@case
def gen_top_k_negative():
    expect_fail(gen_args(GOOD, "--top-k", "-3"), ["--top-k = -3 is out of range"], rc=2)


@case
def gen_seed_negative():
    expect_fail(gen_args(GOOD, "--seed", "-1"), ["--seed = -1 is out of range"], rc=2)


@case
def gen_threads_too_many():
    expect_fail(gen_args(GOOD, "--threads", "100000"), ["--threads = 100000 is out of range"],
                rc=2)


@case
def gen_max_rows_zero():
    expect_fail(gen_args(GOOD, "--max-rows", "0"), ["--max-rows = 0 is out of range"], rc=2)


@case
def gen_both_prompt_and_ids():
    expect_fail(gen_args(GOOD, "--prompt", "hi"), ["exactly one of --prompt or --prompt-ids"],
                rc=2)


@case
def gen_neither_prompt_nor_ids():
    expect_fail(gen_args(GOOD, ids=None), ["exactly one of --prompt or --prompt-ids"], rc=2)


@case
def gen_device_nonsense():
    expect_fail(gen_args(GOOD, "--device", "tpu9"), ["--device tpu9: expected cpu or cuda"], rc=2)


@case
def gen_decode_nonsense():
    expect_fail(gen_args(GOOD, "--decode", "fast"),
                ["--decode fast: expected stock, mono or auto"], rc=2)


@case
def gen_tp_out_of_range():
    expect_fail(gen_args(GOOD, "--tp", "0"), ["--tp"], rc=2)
    expect_fail(gen_args(GOOD, "--tp", "9"), ["--tp"], rc=2)
    expect_fail(gen_args(GOOD, "--tp", "two"), ["--tp"], rc=2)


@case
def gen_tp_does_not_divide():
    # GOOD is the tiny preset: 4 query heads, 2 KV heads
    expect_fail(gen_args(GOOD, "--tp", "3"), ["tp = 3", "num_attention_heads = 4"], rc=1)


@case
def gen_indexer_cp_on_cuda():
    expect_fail(gen_args(GOOD, "--indexer-cp", "--device", "cuda"), ["--indexer-cp", "cuda"],
                rc=1)


@case
def bench_usage():
    expect_fail(["bench"], ["expected 'layer', 'linear' or 'indexer'"], rc=2)
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
def gen_tp_on_cuda_too_few_gpus():
    # one GPU per rank: refused where fewer than 2 GPUs (or no CUDA build);
    # on a machine with 2 or more it is no bad input (scripts/gpu-check)
    smi = shutil.which("nvidia-smi")
    if smi and subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.count("GPU ") >= 2:
        return
    expect_fail(gen_args(GOOD, "--tp", "2", "--device", "cuda"), ["--tp 2 over GPUs"], rc=1)


@case
def gen_model_empty_dir():
    d = case_dir("gen_model_empty_dir")
    expect_fail(gen_args(d), [d, "config.json"], rc=1)


@case
def gen_model_missing_dir():
    d = os.path.join(WORK, "cases", "does-not-exist")
    expect_fail(gen_args(d), [d], rc=1)


@case
def gen_model_is_a_file():
    d = os.path.join(GOOD, "config.json")
    expect_fail(gen_args(d), [d], rc=1)


@case
def gen_model_config_only():
    d = copy_good("gen_model_config_only", weights=False)
    expect_fail(gen_args(d), [d, "safetensors"], rc=1)


@case
def gen_dump_logits_missing_dir():
    target = os.path.join(WORK, "cases", "no-such-dir", "logits.npy")
    expect_fail(gen_args(GOOD, "--dump-logits", target), ["cannot create", "no-such-dir"], rc=1)


@case
def gen_dump_logits_disk_full():
    # the write error itself (ENOSPC) must reach the user
    if not os.path.exists("/dev/full"):
        return
    expect_fail(gen_args(GOOD, "--dump-logits", "/dev/full"),
                ["/dev/full", os.strerror(28)], rc=1)


@case
def gen_stdout_disk_full():
    # tokens that could not be printed are a failure, not exit 0
    if not os.path.exists("/dev/full"):
        return
    with open("/dev/full", "wb") as full:
        expect_fail(gen_args(GOOD), [], rc=(1, 2), report=False, stdout=full)


@case
def gen_model_empty_string():
    expect_fail(gen_args(""), [], rc=(1, 2))


@case
def gen_builtin_cache_dir_is_a_file():
    # no --model: the built-in tiny model cannot be synthesized into the cache
    f = os.path.join(WORK, "cases", "cache_is_a_file")
    os.makedirs(os.path.dirname(f), exist_ok=True)
    with open(f, "w") as fh:
        fh.write("not a folder\n")
    expect_fail(gen_args(None), [f], rc=1, env={"M3_CACHE_DIR": f})


@case
def gen_dump_logits_into_directory():
    d = case_dir("gen_dump_logits_into_directory")
    expect_fail(gen_args(GOOD, "--dump-logits", d), [d], rc=1)


# ------------------------------------------------------------------ synth arguments

def synth_out(name):
    d = os.path.join(WORK, "cases", name)
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
    missing = os.path.join(WORK, "cases", "nope", "config.json")
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
    expect_fail(["synth", "--preset", "tiny", "--config", os.path.join(GOOD, "config.json"),
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
    f = os.path.join(WORK, "cases", "synth_out_under_regular_file.txt")
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
    f = os.path.join(WORK, "cases", "synth_out_is_regular_file.txt")
    os.makedirs(os.path.dirname(f), exist_ok=True)
    with open(f, "w") as fh:
        fh.write("not a folder\n")
    expect_fail(["synth", "--preset", "tiny", "--out", f], [f], rc=1)


@case
def synth_out_read_only_dir():
    if os.geteuid() == 0:
        return  # root writes anywhere; nothing to test
    parent = os.path.join(WORK, "cases", "synth_ro")
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


# ================================================================== main

def main():
    global M3, WORK, GOOD, VERBOSE, ENV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m3", required=True, help="the m3 binary")
    ap.add_argument("--work", required=True, help="scratch folder (emptied)")
    ap.add_argument("--quick", action="store_true", help="accepted for the sanitizer build; runs in full")
    ap.add_argument("-k", default="", help="run only cases whose name holds this")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    M3 = os.path.abspath(a.m3)
    WORK = os.path.abspath(a.work)
    VERBOSE = a.verbose
    if os.path.lexists(WORK):
        for root, dirs, _ in os.walk(WORK):
            for x in dirs:
                try:
                    os.chmod(os.path.join(root, x), 0o755)
                except OSError:
                    pass
        shutil.rmtree(WORK)
    os.makedirs(WORK)
    ENV = dict(os.environ)
    ENV["M3_CACHE_DIR"] = os.path.join(WORK, "cache")  # never touch the user's cache
    ENV.setdefault("UBSAN_OPTIONS", "print_stacktrace=1")

    t0 = time.monotonic()
    GOOD = os.path.join(WORK, "good")
    code, out, err, cmd, _ = run_m3(["synth", "--preset", "tiny", "--out", GOOD])
    if code != 0 or any(m in err for m in BAD_MARKERS):
        print(f"FAIL setup: {shell(cmd)} exited {code}\n{err}")
        return 1

    failed = []
    ran = 0
    for c in CASES:
        if a.k not in c.name:
            continue
        ran += 1
        if VERBOSE:
            print(f"  {c.name}")
        try:
            c.fn()
        except Failure as e:
            failed.append(c.name)
            print(f"FAIL {c.name}: {e}\n", flush=True)
        except Exception as e:  # a harness bug: report it as a failure too
            failed.append(c.name)
            print(f"FAIL {c.name}: harness error {type(e).__name__}: {e}\n", flush=True)
    dt = time.monotonic() - t0
    print(f"test_bad_input: {ran - len(failed)}/{ran} cases passed in {dt:.1f} s")
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
