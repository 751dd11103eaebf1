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

It also notes, without failing, a form known to be slow: in the fused
mono kernels (`mono_pre_kernel`, `mono_post_kernel`) an atomic add's
result stored to local memory within a few instructions (`ATOMG.E.ADD PT,
R5, ...` then `STL [R1+0x8], R5`): a register spill whose store waits out
the atomic's round trip. The item queue's reservation is spilled so in
every kernel short of registers, before the item's first load
(docs/PERF.md, fifty-ninth and sixtieth sessions; branch `rt2` keeps it
out of registers where it is spilled). A note, not a failure, until that
form is the default.

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
ATOM_ADD = re.compile(r"^ATOMG\.E\.ADD\S*\s+PT,\s*(R\d+),")
SPILL_OF = "STL [^,]*, %s$"
SPILL_WINDOW = 6  # instructions after the atomic
MONO_KERNEL = re.compile(r"mono_(pre|post)_kernel")
SPILLED = "an atomic's result spilled right after the atomic"
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
    """(kernel, offset, instruction, what) of every finding in cuobjdump
    -sass output: an odd descriptor register, or (mono kernels) a spilled
    atomic result."""
    kernel, found, atoms = None, [], []  # atoms: [reg, offset, ins, instructions left]
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            kernel, atoms = m.group(1), []
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        offset, ins = m.group(1), m.group(2)
        for reg in ODD_DESC.findall(ins):
            if int(reg) % 2:
                found.append((kernel, offset, ins, "an odd descriptor register"))
                break
        if not MONO_KERNEL.search(kernel or ""):
            continue
        for a in atoms:
            if re.search(SPILL_OF % a[0], ins):
                found.append((kernel, a[1], "%s; %s" % (a[2], ins), SPILLED))
                a[3] = 0
            a[3] -= 1
        atoms = [a for a in atoms if a[3] > 0]
        m = ATOM_ADD.match(ins)
        if m:
            atoms.append([m.group(1), offset, ins, SPILL_WINDOW])
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
    spilled = [b for b in bad if b[4] == SPILLED]
    bad = [b for b in bad if b[4] != SPILLED]
    for path, kernel, offset, ins, what in spilled:
        print("note: %s: %s: %s, /*%s*/ %s" % (path, kernel, what, offset, ins))
    if bad:
        by_kernel = {}
        for path, kernel, offset, ins, what in bad:
            by_kernel.setdefault((path, kernel, what), []).append((offset, ins))
        for (path, kernel, what), hits in sorted(by_kernel.items()):
            print("%s: %s: %d instruction(s) with %s, e.g. /*%s*/ %s"
                  % (path, kernel, len(hits), what, hits[0][0], hits[0][1]))
        print("sass_check: FAILED: %d finding(s) in %d kernel(s) (see this script's header)"
              % (len(bad), len({k[:2] for k in by_kernel})))
        return 1
    print("sass_check: %d kernels, no odd descriptor registers (%d note(s) of a spilled "
          "atomic result in the mono kernels)" % (kernels, len(spilled)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
