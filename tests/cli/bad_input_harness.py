"""The harness of the `m3` program's bad-input tests (test_bad_input.py:
config.json, safetensors files and checkpoint folders; test_bad_args.py:
command-line arguments).

A case is a function registered with @case; it runs `m3` on one broken
thing and raises Failure unless the run refuses it the way the CLI promises
(exit status 1 for a runtime failure or 2 for a usage error, never 0, a
signal or a hang; stderr naming the problem; a runtime failure reported as
"m3 <cmd>: M3_ERR_<...>: <message>"; no sanitizer or crash report). main()
synthesizes the untouched tiny checkpoint both programs start from, runs
the two positive controls below and every registered case.

The paths set by main() are module globals (M3, WORK, GOOD, ENV): case
files read them as `H.GOOD` etc. after `import bad_input_harness as H`.
Python 3 standard library only.
"""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import time

__all__ = ["TIMEOUT_S", "BAD_MARKERS", "REPORT_RE", "PREFIX", "ST_NAME", "case", "Failure",
           "run_m3", "shell", "expect_fail", "gen_args", "expect_gen_fail", "case_dir",
           "copy_good", "load_config", "with_config", "St", "good_st", "with_st",
           "with_st_bytes", "good_bytes", "_del_text", "_del_sparse", "_set_text",
           "_set_sparse", "main"]

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

    @classmethod
    def from_tensors(cls, tensors):
        """A new file of name -> (dtype, shape, raw bytes), in that order."""
        st = cls.__new__(cls)
        st.items, blobs, off = [["__metadata__", {"format": "pt"}]], [], 0
        for name, (dtype, shape, raw) in tensors.items():
            st.items.append([name, {"dtype": dtype, "shape": list(shape),
                                    "data_offsets": [off, off + len(raw)]}])
            blobs.append(raw)
            off += len(raw)
        st.data = b"".join(blobs)
        return st

    def tensors(self):
        """name -> (dtype, shape, raw bytes) of every tensor, in header order."""
        return {k: (v["dtype"], list(v["shape"]),
                    self.data[v["data_offsets"][0]:v["data_offsets"][1]])
                for k, v in self.items if k != "__metadata__"}

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

def _del_text(field):
    return lambda c: c["text_config"].pop(field)


def _del_sparse(field):
    return lambda c: c["text_config"]["sparse_attention_config"].pop(field)


def _set_text(field, value):
    return lambda c: c["text_config"].__setitem__(field, value)


def _set_sparse(field, value):
    return lambda c: c["text_config"]["sparse_attention_config"].__setitem__(field, value)


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


def main(name):
    global M3, WORK, GOOD, VERBOSE, ENV
    ap = argparse.ArgumentParser(description=f"{name}: bad-input cases for the m3 program")
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
    print(f"{name}: {ran - len(failed)}/{ran} cases passed in {dt:.1f} s")
    if failed:
        print("failed: " + ", ".join(failed))
        return 1
    return 0

