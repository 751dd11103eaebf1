#!/usr/bin/env python3
"""Do two sets of cubins hold the same machine code? A refactor check without a GPU.

    scripts/sass_diff.py BEFORE.cubin[,MORE.cubin...] AFTER.cubin[,MORE.cubin...]

Build the cubins with the project's flags, for example
`nvcc -O3 -DNDEBUG -DM3_HAVE_CUDA=1 -D_GNU_SOURCE -arch=sm_90a -cubin -std=c++17
-Iinclude -Isrc src/cuda/cuda_index.cu -o x.cubin`, once before and once after
a change that should not change what runs: moving code between files,
sharing a helper, renaming. This script disassembles every function
(nvdisasm, or $NVDISASM; `pip download nvidia-cuda-nvdisasm` has it) and
compares the multisets of function bodies. Names and addresses are left
out, so moved or renamed functions still match. Identical bodies mean
identical behaviour. Any difference is listed by function name, and the
exit status is then 1.
"""
import collections
import hashlib
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_check import cuda_tool  # noqa: E402 (one lookup for the CUDA tools)


def nvdisasm():
    path = cuda_tool("nvdisasm")  # $NVDISASM, PATH, the CUDA toolkit, PyPI's wheel
    if not path:
        sys.exit("sass_diff: nvdisasm not found (set NVDISASM)")
    return path


def bodies(cubins, tool):
    count, names = collections.Counter(), {}
    for cubin in cubins:
        run = subprocess.run([tool, cubin], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit("sass_diff: nvdisasm failed on %s: %s" % (cubin, run.stderr.strip()))
        name, body = None, []

        def flush():
            if name is not None:
                digest = hashlib.sha1("\n".join(body).encode()).hexdigest()[:16]
                count[digest] += 1
                names.setdefault(digest, []).append(name)

        for line in run.stdout.splitlines():
            m = re.match(r"\s*\.text\.(\S+):", line)
            if m:
                flush()
                name, body = m.group(1), []
                continue
            if name is None or not re.match(r"\s+/\*[0-9a-f]{4,}\*/", line):
                continue
            line = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)  # addresses
            line = re.sub(r"`\([^)]*\)", "`(SYM)", line)  # call targets by name
            body.append(re.sub(r"\s+", " ", line).strip())
        flush()
    return count, names


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    tool = nvdisasm()
    before, before_names = bodies(sys.argv[1].split(","), tool)
    after, after_names = bodies(sys.argv[2].split(","), tool)
    print("functions: %d before, %d after" % (sum(before.values()), sum(after.values())))
    differ = (before - after) + (after - before)
    if not differ:
        print("identical machine code")
        return 0
    for digest in differ:
        print("differs: %s" % ", ".join(before_names.get(digest) or after_names.get(digest)))
    return 1


if __name__ == "__main__":
    sys.exit(main())
