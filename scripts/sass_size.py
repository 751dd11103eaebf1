#!/usr/bin/env python3
"""How many machine instructions does each source function put into a kernel?

    scripts/sass_size.py KERNEL.cubin NAME [--top N] [--lines FILE:FIRST-LAST] [--spills]

The fused kernels' chain items run once per step on one SM, with their code
cold: fetching it is about a third of such an item's work (docs/PERF.md,
tenth session). So their code size is a cost to measure, without a GPU.
Build a cubin with line information, for example
`nvcc -std=c++17 -O3 -DNDEBUG -lineinfo -gencode=arch=compute_90a,code=sm_90a
-Isrc -Iinclude -cubin src/cuda/cuda_mono_kernels.cu -o k.cubin`, then give
a substring of the kernel's mangled name (`post_kernelILi1E`: the post
kernel for one row). The script disassembles it (nvdisasm -g, or
$NVDISASM) and counts the instructions attributed to each source line, then
sums them per source file and per enclosing function. The enclosing
function is the last `__device__` or `__global__` definition above the line
in that file: crude, but stable between builds. Inlined code is counted
where its source lines are, so a helper inlined in six places counts six
times. --lines sums one line range (e.g. a loop) of one file. --spills
lists instead the local-memory loads and stores (LDL / STL: register
spills, or arrays the compiler could not keep in registers) per source
line: ptxas -v gives only their byte total, and a spill in a hot loop
costs more than one on a path that never runs (docs/PERF.md, eleventh
session: the 16-row GEMV's weight registers).
"""
import argparse
import collections
import os
import re
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_diff import nvdisasm  # noqa: E402 (the same lookup: $NVDISASM, PATH, CUDA)

DEF = re.compile(r"^(?:template <[^>]*>\s*)?(?:static\s+)?__(?:device|global)__[^(]*?(\w+)\s*\(")


LOCAL = re.compile(r"\b(STL|LDL)(\.\w+)*\s")


def instructions(cubin, name):
    """(function, offset, text, (file path, line) or None) of every
    instruction of the functions whose name contains name, in order."""
    run = subprocess.run([nvdisasm(), "-g", "-c", cubin], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit("sass_size: nvdisasm failed: %s" % run.stderr.strip())
    fn, where, seen = None, None, False
    for text in run.stdout.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.([^,\s]+)", text)
        if m:
            fn = m.group(1)
            where = None
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", text)
        if fn and name in fn and m:
            seen = True
            yield fn, int(m.group(1), 16), text, where
    if not seen:
        sys.exit("sass_size: no function in %s contains %r" % (cubin, name))


def line_counts(cubin, name, only=None):
    """{(file path, line): instructions} for the functions whose name contains
    name; with only (a compiled regex), just the instructions it finds."""
    counts, seen = collections.Counter(), set()
    for fn, _, text, where in instructions(cubin, name):
        seen.add(fn)
        if only is None:
            counts[where] += 1
        else:
            m = only.search(text)
            if m:
                counts[(where, m.group(1))] += 1
    return counts, sorted(seen)


def enclosing(path, cache):
    """line -> name of the function defined last above it (0 lines: unknown)."""
    if path not in cache:
        names, cur = {}, "?"
        try:
            for i, text in enumerate(open(path, errors="replace"), 1):
                m = DEF.match(text)
                if m:
                    cur = m.group(1)
                names[i] = cur
        except OSError:
            pass
        cache[path] = names
    return cache[path]


def line_label(where, cache):
    """'file:line (function)' for a (path, line) of line_counts / instructions."""
    if where is None:
        return "(no line)"
    path, line = where
    return "%s:%d (%s)" % (os.path.basename(path), line, enclosing(path, cache).get(line, "?"))


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quiet under `| head`
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin")
    ap.add_argument("name", help="a substring of the kernel's (mangled) name")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--lines", help="FILE:FIRST-LAST, summed on its own")
    ap.add_argument("--spills", action="store_true", help="local loads / stores per source line")
    args = ap.parse_args()
    if args.spills:
        return spills(args)
    counts, fns = line_counts(args.cubin, args.name)
    total = sum(counts.values())
    print("%s: %s, %d instructions (%d KB)" % (args.cubin, ", ".join(fns), total, total * 16 // 1024))
    by_file, by_fn, cache = collections.Counter(), collections.Counter(), {}
    for where, n in counts.items():
        if where is None:
            by_file["(no line)"] += n
            continue
        path, line = where
        base = os.path.basename(path)
        by_file[base] += n
        by_fn["%s:%s" % (base, enclosing(path, cache).get(line, "?"))] += n
    print("\nper file:")
    for k, n in by_file.most_common(args.top):
        print("  %7d  %s" % (n, k))
    print("\nper function (file:function):")
    for k, n in by_fn.most_common(args.top):
        print("  %7d  %s" % (n, k))
    if args.lines:
        m = re.match(r"(.+):(\d+)-(\d+)$", args.lines)
        if not m:
            sys.exit("sass_size: --lines wants FILE:FIRST-LAST")
        f, a, b = m.group(1), int(m.group(2)), int(m.group(3))
        n = sum(v for w, v in counts.items() if w and w[0].endswith(f) and a <= w[1] <= b)
        print("\n%s lines %d-%d: %d instructions" % (f, a, b, n))


def spills(args):
    counts, fns = line_counts(args.cubin, args.name, LOCAL)
    kinds = collections.Counter()
    by_line, cache = collections.defaultdict(collections.Counter), {}
    for (where, kind), n in counts.items():
        kinds[kind] += n
        by_line[where][kind] += n
    print("%s: %s, %d local stores (STL), %d local loads (LDL)"
          % (args.cubin, ", ".join(fns), kinds["STL"], kinds["LDL"]))
    rows = sorted(by_line.items(), key=lambda kv: -sum(kv[1].values()))[: args.top]
    for where, c in rows:
        print("  STL %4d  LDL %4d  %s" % (c["STL"], c["LDL"], line_label(where, cache)))


if __name__ == "__main__":
    main()
