#!/usr/bin/env python3
"""Where did a kernel's warps stall? PC samples per source line.

    scripts/stall_lines.py KERNEL.cubin NAME SASS.csv [--top N]

Nsight Compute's SASS page (`scripts/gpu-profile` with PROFILE_STALLS=1
writes it: stalls-rows*.sass.csv) has the warp-stall samples of every
instruction, by address, but no source lines. A cubin built here from the
same source with the same nvcc and flags (`nvcc -std=c++17 -O3 -DNDEBUG
-lineinfo -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -cubin
src/cuda/cuda_mono_kernels.cu -o k.cubin`) has the same machine code, so an
instruction's offset from the kernel's first one names its line. NAME is a
substring of the kernel's mangled name (`post_kernelILi16ELi0E`). The script
checks that every profiled instruction matches the cubin's (the count of
mismatches is printed: anything but 0 means another build), then prints the
source lines with the most samples, each with its top stall reasons
(barrier: waiting at __syncthreads; long_sb: for a global or local load;
short_sb: for shared memory; wait: a fixed-latency dependency; selected:
issuing, i.e. working).
"""
import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_size import instructions, line_label  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cubin")
    ap.add_argument("name", help="a substring of the kernel's (mangled) name")
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = {h: i for i, h in enumerate(rows[head])}
    body = [r for r in rows[head + 1:] if r and r[0].startswith("0x")]
    if not body:
        sys.exit("stall_lines: no instructions in %s" % args.csv)
    reasons = [h for h in cols if h.startswith("stall_") and "Not Issued" not in h]
    fns = collections.Counter()
    code = {}
    for fn, off, text, where in instructions(args.cubin, args.name):
        fns[fn] += 1
        code[off] = (text, where)
    if len(fns) != 1:
        sys.exit("stall_lines: %r names %d kernels: %s" % (args.name, len(fns), ", ".join(fns)))
    base = int(body[0][0], 16)
    per, mismatch, total = collections.defaultdict(collections.Counter), 0, 0
    for r in body:
        off = int(r[0], 16) - base
        text, where = code.get(off, ("", None))
        opcode = r[1].split()
        opcode = [w for w in opcode if not w.startswith("@")][:1]
        if not opcode or opcode[0].split(".")[0] not in text:
            mismatch += 1
        n = int(r[cols["Warp Stall Sampling (All Samples)"]] or 0)
        total += n
        per[where]["all"] += n
        for h in reasons:
            per[where][h[6:]] += int(r[cols[h]] or 0)
    print("%s: %d instructions profiled, %d in the cubin, %d mismatched; %d samples"
          % (args.csv, len(body), len(code), mismatch, total))
    cache = {}
    for where, c in sorted(per.items(), key=lambda kv: -kv[1]["all"])[: args.top]:
        top = " ".join("%s=%d" % (k, v) for k, v in c.most_common(5) if k != "all")
        print("  %5.2f%%  %-44s %s" % (100.0 * c["all"] / max(total, 1),
                                       line_label(where, cache), top))


if __name__ == "__main__":
    main()
