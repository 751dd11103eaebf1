#!/usr/bin/env python3
"""Is the built machine code free of instruction forms known to be illegal?

    scripts/sass_check.py FILE...   (objects, static libraries, executables, cubins)
    scripts/sass_check.py --tools   (exit 0 when cuobjdump and nvdisasm are found)

A check without a GPU, run by ctest wherever the CUDA backend is built
(test `sass_check`) and so in CI. It disassembles every kernel of FILE
(cuobjdump -sass, which calls nvdisasm) and fails on the forms below,
naming the kernel and the instruction.

- A memory descriptor in an odd uniform register (`desc[UR1]`): a
  descriptor is a 64-bit pair and starts at an even register. nvcc 13.0
  emits one for a cp.async with an L2 cache hint whose shared address is a
  uniform base plus a thread's offset (`LDGSTS [R+UR0], desc[UR1]`), and the
  kernel stops with an illegal instruction when it reaches it (docs/PERF.md,
  thirty-third and thirty-fourth sessions; cuda_async.cuh's
  cp_async16_pol_s is the form that compiles well).

Tools: $CUOBJDUMP / $NVDISASM, else PATH, else /usr/local/cuda/bin, else
the PyPI wheels `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` (which
`make deps` installs where nvcc is and cuobjdump is not). Without them the
check prints SKIP and exits 77 (ctest: skipped). Exit 1 on a finding, 2 on
a tool failure.
"""
import os
import re
import shutil
import subprocess
import sys

ODD_DESC = re.compile(r"desc\[UR(\d+)\]")
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def cuda_tool(name):
    """The path of a CUDA tool (cuobjdump, nvdisasm), or None."""
    path = os.environ.get(name.upper()) or shutil.which(name)
    if path and os.path.isfile(path):
        return path
    candidates = [os.path.join("/usr/local/cuda/bin", name)]
    for root in sys.path:  # the wheels' layouts (13.x: nvidia/cu13/bin)
        for sub in ("cu13", "cu12", "cuda_cuobjdump", "cuda_nvdisasm"):
            candidates.append(os.path.join(root, "nvidia", sub, "bin", name))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def findings(text):
    """(kernel, offset, instruction) of every instruction with an odd
    descriptor register in cuobjdump -sass output."""
    kernel, found = None, []
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            kernel = m.group(1)
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        for reg in ODD_DESC.findall(m.group(2)):
            if int(reg) % 2:
                found.append((kernel, m.group(1), m.group(2)))
                break
    return found


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cuobjdump, nvdisasm = cuda_tool("cuobjdump"), cuda_tool("nvdisasm")
    if argv[0] == "--tools":  # are both tools there? (make deps asks)
        print("cuobjdump: %s\nnvdisasm: %s" % (cuobjdump, nvdisasm))
        return 0 if cuobjdump and nvdisasm else 1
    if not cuobjdump or not nvdisasm:
        print("SKIP: sass_check needs cuobjdump and nvdisasm (set CUOBJDUMP / NVDISASM, or "
              "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
        return 77
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    bad, kernels = [], 0
    for path in argv:
        if not os.path.isfile(path):
            print("sass_check: no such file: %s" % path, file=sys.stderr)
            return 2
        run = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, env=env)
        if run.returncode != 0:
            print("sass_check: %s -sass %s failed: %s" % (cuobjdump, path, run.stderr.strip()),
                  file=sys.stderr)
            return 2
        kernels += sum(1 for line in run.stdout.splitlines() if FUNCTION.match(line))
        bad += [(path,) + f for f in findings(run.stdout)]
    if kernels == 0:
        print("sass_check: no kernels in %s" % " ".join(argv), file=sys.stderr)
        return 2
    if bad:
        by_kernel = {}
        for path, kernel, offset, ins in bad:
            by_kernel.setdefault((path, kernel), []).append((offset, ins))
        for (path, kernel), hits in sorted(by_kernel.items()):
            print("%s: %s: %d instruction(s) with an odd descriptor register, e.g. /*%s*/ %s"
                  % (path, kernel, len(hits), hits[0][0], hits[0][1]))
        print("sass_check: FAILED: %d instruction(s) in %d kernel(s) (see this script's header)"
              % (len(bad), len(by_kernel)))
        return 1
    print("sass_check: %d kernels, no odd descriptor registers" % kernels)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
