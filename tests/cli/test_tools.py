#!/usr/bin/env python3
"""The device-run tools that can be checked without a GPU.

- scripts/mono_trace.py on a synthetic item trace: per-kind medians, the
  split of a CTA's first item of a kind from its later ones ("1st / again"),
  the marks' medians over all items, first items and later items, and the
  time between the two kernels (printed only when both are traced).
- scripts/gpu-ab on a throwaway git repository whose scripts/gpu-check is a
  stand-in (it records the CUDAFLAGS it was given and writes a fake m3 and a
  ctest folder): `extra NAME REV CUDAFLAGS` reaches that build only, the
  table labels it with its flags, and `run --test-all` runs every build's
  tests where `--test` runs the working tree's only; `--linear` adds
  every build's `bench linear` at M3_LINEAR_MMA_ROWS=32; after `prebuild`,
  `run` times the kept binaries and builds only a tree changed since.

- scripts/gpu-check's dev_tool with stand-in nvcc and compute-sanitizer
  (the `select` and `cublasinit` stages): the tool's table and the
  sanitizer's findings land in NAME.md, an error fails `select` but not
  `cublasinit` (SANITIZE_REPORT_ONLY), the binary is removed, and
  NVCC_LIBS reaches the link; its build stage (a stand-in cmake) gives
  cmake CUDAFLAGS explicitly, empty when unset, so a reused build folder
  does not keep an earlier run's switches from its cache; its initcheck
  stage runs the CLI with prefill chunks of 16 rows (no cuBLAS) on both
  decode paths before the two test programs, those with
  M3_LINEAR_CUBLAS=0 (the linear kept off cuBLAS).

- tests/gpu/cuda_configs.py with `--device cpu` (the CPU engine on both
  sides: every check passes, a mono refusal counts as a pass) and its
  comparison rule on made-up logits: equal tokens within the bound pass, a
  parting at a near-tie warns, at a clear margin or beyond the bound fails.

- scripts/gpu-parting with the CPU in the GPU's place on the tiny model:
  its runs agree and it leaves at most 8 files in $OUT.

- scripts/mono_queue_sim.py: hand-worked queues (CTAs take items in queue
  order when free; a down item waits for its expert's last gate/up item,
  then a poll), its presets reproduce the traces they came from, and a
  preset read from a synthetic item trace.

- scripts/sass_check.py on made-up disassembly (stand-in cuobjdump and
  nvdisasm): an odd descriptor register fails and names its kernel, even
  ones pass, a file without kernels is an error.

- scripts/perf_report.py on made-up stock and mono JSON: its --out folder
  made when missing, each point's floor and time / floor in results.md.

Run by ctest as: test_tools.py --m3 build/m3 --work DIR [--quick] (m3 is
used by the cuda_configs.py and gpu-parting checks only).
"""
import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fail(msg):
    sys.exit("FAILED: " + msg)


def check_mono_trace(work):
    # columns: kernel kind cta item start end ready marks... (ns); kernel 1 =
    # post, kind 2 = o_proj. CTA 0 runs items 0 then 1, CTA 1 runs item 2.
    rows = [
        (1, 2, 0, 0, 1000, 9000, 2000, 3000, 6000),   # CTA 0's first: marks 1.0, 4.0 us
        (1, 2, 0, 1, 9000, 12000, 9000, 9500, 10000),  # CTA 0's again: 0.5, 1.0
        (1, 2, 1, 2, 1000, 8000, 2000, 4000, 7000),   # CTA 1's first: 2.0, 5.0
    ]
    path = os.path.join(work, "trace.txt")
    with open(path, "w") as f:
        f.write("kernel kind cta item start end ready marks\n")
        for r in rows:
            f.write(" ".join(map(str, r)) + "\n")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mono_trace.py"), path],
                         capture_output=True, text=True, timeout=60)
    if res.returncode != 0:
        fail("mono_trace.py: %s" % res.stderr)
    out = res.stdout
    kind = [l for l in out.splitlines() if l.strip().startswith("o_proj")]
    if len(kind) != 1 or "n=    3" not in kind[0]:
        fail("mono_trace.py: no o_proj line with 3 items:\n" + out)
    # work = end - ready: firsts 7.0 and 6.0 us (median of two: the upper), again 3.0
    if "1st / again   7.00 /   3.00" not in kind[0]:
        fail("mono_trace.py: first / again work split:\n" + out)
    want = {
        "marks after ready: ": "1.00 (n=3) 4.00 (n=3)",
        "marks after ready 1st: ": "2.00 (n=2) 5.00 (n=2)",
        "marks after ready again: ": "0.50 (n=1) 1.00 (n=1)",
    }
    for label, values in want.items():
        lines = [l.strip() for l in out.splitlines() if l.strip().startswith(label)]
        if lines != [label + values]:
            fail("mono_trace.py: %r should be %r, got %r\n%s" % (label, values, lines, out))
    if "between kernels" in out:
        fail("mono_trace.py: a gap between kernels from a trace of one kernel:\n" + out)
    # a pre kernel item (kernel 0, kind 1 = proj) from -500 to 800 ns; the post
    # kernel's first item starts at 1000 and its last ends at 12000: 0.2 us
    # between the kernels, 12.5 us in all
    with open(path, "a") as f:
        f.write("0 1 5 0 -500 800 -500\n")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mono_trace.py"), path],
                         capture_output=True, text=True, timeout=60)
    want = ("between kernels: the post kernel's first item started 0.2 us after the pre "
            "kernel's last item ended; 12.5 us from the first item to the last")
    if res.returncode != 0 or want not in res.stdout:
        fail("mono_trace.py: the gap between kernels:\n" + res.stdout + res.stderr)


STAND_IN = r"""#!/bin/bash
# a stand-in for scripts/gpu-check's build stage: records CUDAFLAGS, writes a
# fake m3 (prints one benchmark point) and a ctest folder with one gpu test
B=${BUILD:-build-gpu}
mkdir -p "$OUT" "$B"
echo "CUDAFLAGS=[$CUDAFLAGS]" >"$OUT/flags.txt"
cat >"$B/m3" <<'EOM'
#!/bin/bash
if [ "$2" = linear ]; then echo "linear $3 $4 MMA_ROWS=$M3_LINEAR_MMA_ROWS"; exit 0; fi
echo '{"points":[{"path":"mono","rows":1,"context":4096,"median_us":100.0}]}'
EOM
chmod +x "$B/m3"
# the test programs named in GPU_CHECK_TARGETS (gpu-ab prebuild): each
# prints a passing summary and its arguments
IFS=, read -ra T <<<"${GPU_CHECK_TARGETS:-}"
for t in "${T[@]}"; do
    [ "$t" = m3 ] && continue
    printf '#!/bin/bash\necho "%s $*: 1 checks, 0 failed"\n' "$t" >"$B/$t"
    chmod +x "$B/$t"
done
cat >"$B/CTestTestfile.cmake" <<EOM
add_test(stand_in "/bin/true")
set_tests_properties(stand_in PROPERTIES LABELS "gpu")
EOM
"""


def sh(cmd, cwd, env=None):
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    if res.returncode != 0:
        fail("%s: exit %d\n%s\n%s" % (" ".join(cmd), res.returncode, res.stdout, res.stderr))
    return res.stdout + res.stderr


def check_gpu_ab(work):
    if not shutil.which("git") or not shutil.which("ctest"):
        print("gpu-ab: skipped (git or ctest missing)")
        return
    repo = os.path.join(work, "repo")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(os.path.join(repo, "scripts"))
    shutil.copy(os.path.join(ROOT, "scripts", "gpu-ab"), os.path.join(repo, "scripts"))
    with open(os.path.join(repo, "scripts", "gpu-check"), "w") as f:
        f.write(STAND_IN)
    os.chmod(os.path.join(repo, "scripts", "gpu-check"), 0o755)
    model = os.path.join(work, "model")
    os.makedirs(model, exist_ok=True)
    open(os.path.join(model, "config.json"), "w").write("{}")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", M3_BENCH_MODEL=model)
    env.pop("CUDAFLAGS", None)
    sh(["git", "init", "-q"], repo, env)
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "commit", "-qm", "stand-in"], repo, env)
    sh(["scripts/gpu-ab", "prepare", "HEAD"], repo, env)
    sh(["scripts/gpu-ab", "extra", "sw", "HEAD", "-DM3_SWITCH=8"], repo, env)
    for opt, tested in (("--test-all", ("base", "new", "sw")), ("--test", ("new",))):
        out_dir = os.path.join(work, "out" + opt)
        shutil.rmtree(out_dir, ignore_errors=True)
        linear = ["--linear", "1,32"] if opt == "--test" else []
        log = sh(["scripts/gpu-ab", "run", "--rows", "1", "--rounds", "1", opt] + linear, repo,
                 dict(env, OUT=out_dir))
        table = open(os.path.join(out_dir, "ab.md")).read()
        if "| sw 1 (HEAD -DM3_SWITCH=8) | 100.0 |" not in table:
            fail("gpu-ab: the switch build's row:\n" + table)
        if linear:  # every build's `bench linear`, 17-32 rows on the MMA kernel
            lin = open(os.path.join(out_dir, "ab_linear.md")).read()
            want = "".join("### %s, round 1\nlinear --rows 1,32 MMA_ROWS=32\n" % t
                           for t in ("base", "new", "sw"))
            if sorted(lin.split("### ")) != sorted(want.split("### ")):
                fail("gpu-ab --linear wrote:\n%s\nexpected:\n%s" % (lin, want))
        ran = sorted(l.split()[5] for l in log.splitlines() if l.startswith("gpu-ab: GPU tests of"))
        if ran != sorted(tested):
            fail("gpu-ab %s ran the tests of %s, expected %s\n%s" % (opt, ran, tested, log))
        raw = os.path.join(work, "raw" + opt)
        shutil.rmtree(raw, ignore_errors=True)
        os.makedirs(raw)
        sh(["tar", "xzf", os.path.join(out_dir, "ab-raw.tgz"), "-C", raw], work)
        flags = {t: open(os.path.join(raw, t, "flags.txt")).read().strip()
                 for t in ("base", "new", "sw")}
        want = {"base": "CUDAFLAGS=[]", "new": "CUDAFLAGS=[]", "sw": "CUDAFLAGS=[-DM3_SWITCH=8]"}
        if flags != want:
            fail("gpu-ab: build flags %s, expected %s" % (flags, want))
    # prebuild: each tree's m3 kept in .ab, and the working tree's test
    # programs; run --test times and tests those without building (no
    # build's flags.txt), and a tree changed since is built again
    sh(["scripts/gpu-ab", "prebuild"], repo, dict(env, TMPDIR=work))
    out_dir = os.path.join(work, "out-prebuilt-tests")
    shutil.rmtree(out_dir, ignore_errors=True)
    log = sh(["scripts/gpu-ab", "run", "--rows", "1", "--rounds", "1", "--test"], repo,
             dict(env, OUT=out_dir))
    raw = os.path.join(work, "raw-prebuilt-tests")
    shutil.rmtree(raw, ignore_errors=True)
    os.makedirs(raw)
    sh(["tar", "xzf", os.path.join(out_dir, "ab-raw.tgz"), "-C", raw], work)
    tests_log = open(os.path.join(raw, "new", "gpu-tests.log")).read()
    built = [t for t in ("base", "new", "sw") if os.path.exists(os.path.join(raw, t, "flags.txt"))]
    if built or "new: prebuilt tests" not in log or \
            "test_mono_walk --device cuda: 1 checks, 0 failed" not in tests_log or \
            "test_cuda_mono : 1 checks" not in tests_log:
        fail("gpu-ab run --test with prebuilt tests: built %s\n%s\n%s" % (built, log, tests_log))
    os.makedirs(os.path.join(repo, "src"), exist_ok=True)
    open(os.path.join(repo, "src", "changed.c"), "w").write("/* changed */\n")
    out_dir = os.path.join(work, "out-prebuilt")
    shutil.rmtree(out_dir, ignore_errors=True)
    log = sh(["scripts/gpu-ab", "run", "--rows", "1", "--rounds", "1"], repo,
             dict(env, OUT=out_dir))
    used = sorted(l.split()[1].rstrip(":") for l in log.splitlines()
                  if l.endswith(": prebuilt m3"))
    if used != ["base", "sw"] or "new: its sources changed since prebuild" not in log:
        fail("gpu-ab prebuild: prebuilt m3 used for %s, expected base and sw\n%s" % (used, log))
    raw = os.path.join(work, "raw-prebuilt")
    shutil.rmtree(raw, ignore_errors=True)
    os.makedirs(raw)
    sh(["tar", "xzf", os.path.join(out_dir, "ab-raw.tgz"), "-C", raw], work)
    built = sorted(t for t in ("base", "new", "sw")
                   if os.path.exists(os.path.join(raw, t, "flags.txt")))
    if built != ["new"] or "| sw 1 (HEAD -DM3_SWITCH=8) | 100.0 |" not in \
            open(os.path.join(out_dir, "ab.md")).read():
        fail("gpu-ab prebuild: built %s on the device, expected new only" % built)
    # prebuild again: base and sw are up to date (kept), new (changed) is built
    log = sh(["scripts/gpu-ab", "prebuild"], repo, dict(env, TMPDIR=work))
    kept = sorted(l.split()[1].rstrip(":") for l in log.splitlines() if l.endswith("is up to date"))
    if kept != ["base", "sw"] or "building new's m3" not in log:
        fail("gpu-ab prebuild again: kept %s, expected base and sw, new built\n%s" % (kept, log))

# stand-ins for gpu-check's dev_tool: nvcc writes a "binary" that prints a
# table and records its link flags; compute-sanitizer prints one finding
# and honours --error-exitcode as the real one does
FAKE_NVCC = """#!/bin/sh
out=""; prev=""; libs=""
for a in "$@"; do [ "$prev" = -o ] && out=$a; case $a in -l*) libs="$libs $a";; esac; prev=$a; done
printf '#!/bin/sh\necho "| table of %s |"\n' "$out" >"$out"; chmod +x "$out"
[ -n "$out" ] && echo "$(basename "$out"):$libs" >>"$OUT/nvcc_libs.txt"
"""
FAKE_SANITIZER = """#!/bin/sh
code=0; prev=""
for a in "$@"; do [ "$prev" = --error-exitcode ] && code=$a; prev=$a; done
echo "========= COMPUTE-SANITIZER"
echo "========= Error: a hazard found by $2"
echo "========= ERROR SUMMARY: 1 error"
exit $code
"""


def check_gpu_check(work):
    if not os.path.exists("/usr/include/cjson/cJSON.h"):
        print("gpu-check dev_tool: skipped (no libcjson headers)")
        return
    repo = os.path.join(work, "gpucheck")
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(os.path.join(repo, "scripts"))
    os.makedirs(os.path.join(repo, "dev", "cuda"))
    os.makedirs(os.path.join(repo, "bin"))
    shutil.copy(os.path.join(ROOT, "scripts", "gpu-check"), os.path.join(repo, "scripts"))
    fake_cmake = "#!/bin/sh\necho \"$*\" >>\"$OUT/cmake_args.txt\"\n"
    for name, text in (("nvcc", FAKE_NVCC), ("compute-sanitizer", FAKE_SANITIZER),
                       ("cmake", fake_cmake)):
        path = os.path.join(repo, "bin", name)
        open(path, "w").write(text)
        os.chmod(path, 0o755)
    out = os.path.join(work, "gpucheck-out")
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ, OUT=out, GPU_CHECK_STAGES="select,cublasinit",
               PATH=os.path.join(repo, "bin") + os.pathsep + os.environ["PATH"])
    res = subprocess.run(["scripts/gpu-check"], cwd=repo, capture_output=True, text=True,
                         timeout=120, env=env)
    log = res.stdout + res.stderr
    if res.returncode == 0 or "[FAILED] select" not in log or "[ok]     cublasinit" not in log:
        fail("gpu-check dev_tool: want select failed (a sanitizer error) and cublasinit ok "
             "(report only), got exit %d:\n%s" % (res.returncode, log))
    for name, tools in (("select_top", ("memcheck", "racecheck")),
                        ("initcheck_cublas", ("initcheck",))):
        md = open(os.path.join(out, name + ".md")).read()
        if "| table of %s/%s.bin |" % (out, name) not in md:
            fail("gpu-check dev_tool: %s.md lacks the tool's table:\n%s" % (name, md))
        for tool in tools:
            if "a hazard found by %s" % tool not in md:
                fail("gpu-check dev_tool: %s.md lacks %s's finding:\n%s" % (name, tool, md))
            if not os.path.exists(os.path.join(out, "%s.%s.log" % (name, tool))):
                fail("gpu-check dev_tool: no %s.%s.log" % (name, tool))
        if os.path.exists(os.path.join(out, name + ".bin")):
            fail("gpu-check dev_tool: %s.bin left in $OUT" % name)
    libs = open(os.path.join(out, "nvcc_libs.txt")).read().splitlines()
    if libs != ["select_top.bin:", "initcheck_cublas.bin: -lcublas"]:
        fail("gpu-check dev_tool: want no libraries for select_top and -lcublas for "
             "initcheck_cublas, got %r" % libs)
    # the build stage twice in one folder: with a switch, then without
    for flags in ("-DM3_X=1", None):
        env = dict(os.environ, OUT=out, GPU_CHECK_STAGES="build",
                   PATH=os.path.join(repo, "bin") + os.pathsep + os.environ["PATH"])
        env.pop("CUDAFLAGS", None)
        if flags:
            env["CUDAFLAGS"] = flags
        subprocess.run(["scripts/gpu-check"], cwd=repo, capture_output=True, text=True,
                       timeout=120, env=env)
    configs = [l for l in open(os.path.join(out, "cmake_args.txt")).read().splitlines()
               if l.startswith("-S ")]
    if (len(configs) != 2 or "-DCMAKE_CUDA_FLAGS=-DM3_X=1 " not in configs[0] + " "
            or "-DCMAKE_CUDA_FLAGS= " not in configs[1] + " "):
        fail("gpu-check build: want -DCMAKE_CUDA_FLAGS=-DM3_X=1, then empty, got %r" % configs)
    # the initcheck stage: the CLI first, twice, prefill chunks of 16 rows
    logger = os.path.join(repo, "bin2", "compute-sanitizer")
    os.makedirs(os.path.dirname(logger))
    open(logger, "w").write("#!/bin/sh\necho \"cublas=${M3_LINEAR_CUBLAS-unset} $*\" "
                            ">>\"$OUT/sanitizer_args.txt\"\n")
    os.chmod(logger, 0o755)
    env = dict(os.environ, OUT=out, GPU_CHECK_STAGES="initcheck", BUILD="B",
               PATH=os.path.dirname(logger) + os.pathsep + os.environ["PATH"])
    res = subprocess.run(["scripts/gpu-check"], cwd=repo, capture_output=True, text=True,
                         timeout=120, env=env)
    runs = open(os.path.join(out, "sanitizer_args.txt")).read().splitlines()
    want = ["cublas=unset --tool initcheck --error-exitcode 1 --print-limit 50 B/m3 generate "
            "--device cuda --decode %s --max-rows 16 --prompt-ids %s --max-tokens 8 --ignore-eos"
            % (d, ",".join(str(i) for i in range(1, 41))) for d in ("stock", "mono")]
    # then the two test programs with the linear kept off cuBLAS
    tests_ok = len(runs) == 4 and all(
        r.startswith("cublas=0 --tool initcheck ") and r.endswith(t)
        for r, t in zip(runs[2:], ("B/test_cuda_ops", "B/test_cuda_model")))
    if res.returncode != 0 or runs[:2] != want or not tests_ok:
        fail("gpu-check initcheck: want the CLI at 16-row chunks, stock then mono, then the "
             "two tests under M3_LINEAR_CUBLAS=0; exit %d, got %r" % (res.returncode, runs))
    print("gpu-check dev_tool: tables, sanitizer findings, strict and report-only stages; "
          "build: CUDAFLAGS given to cmake; initcheck: the CLI without cuBLAS first, then the "
          "tests with M3_LINEAR_CUBLAS=0")


def check_cuda_configs(m3, work, quick):
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    import numpy as np
    import cuda_configs as C
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((4, 50)).astype(np.float32)
    order = np.argsort(logits[2])
    logits[2, order[-2]] = logits[2, order[-1]] - 1e-5  # a near-tie at row 2
    toks = [int(t) for t in np.argmax(logits, axis=1)]
    near = list(toks)
    near[2] = int(order[-2])
    clear = list(toks)
    clear[1] = (toks[1] + 1) % 50
    cases = [("equal", toks, logits + 1e-4, "PASS"), ("near-tie", near, logits + 1e-4, "WARN"),
             ("clear margin", clear, logits + 1e-4, "FAIL"),
             ("beyond the bound", toks, logits * 1.5, "FAIL"),
             ("short", toks[:3], logits[:3], "FAIL")]
    for name, got, got_logits, want in cases:
        verdict, text = C.compare(toks, logits, got, got_logits)
        if verdict != want:
            fail("cuda_configs.compare, %s: %s (%s), expected %s" % (name, verdict, text, want))
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "cuda_configs.py"),
                          "--m3", m3, "--work", os.path.join(work, "cuda_configs"),
                          "--device", "cpu", "--count", "1" if quick else "2"],
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0 or "0 failed, 0 warnings" not in res.stdout:
        fail("cuda_configs.py --device cpu: exit %d\n%s%s" % (res.returncode, res.stdout,
                                                             res.stderr))
    print(res.stdout.strip().splitlines()[-1])


def check_gpu_parting(m3, work):
    """scripts/gpu-parting with the CPU in the GPU's place (M3_PARTING_DEVICE=cpu)
    on the tiny model: every run's tokens and logits equal (the CPU's stock and
    mono paths are bit-identical), at most 8 files in $OUT (what the device
    tool brings back), the runs' JSON and stderr in one tar."""
    model = os.path.join(work, "parting_tiny")
    out = os.path.join(work, "parting_out")
    shutil.rmtree(out, ignore_errors=True)
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([m3, "synth", "--preset", "tiny", "--out", model], check=True,
                       capture_output=True, timeout=300)
    env = dict(os.environ, OUT=out, BUILD=os.path.dirname(m3), M3_PARTING_MODEL=model,
               M3_PARTING_DEVICE="cpu", M3_PARTING_CPU="1", M3_PARTING_FIRST="1 2",
               M3_PARTING_PROMPT_LEN="300", WORK=os.path.join(work, "parting_work"))
    res = subprocess.run([os.path.join(ROOT, "scripts", "gpu-parting")], env=env,
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        fail("gpu-parting: exit %d\n%s%s" % (res.returncode, res.stdout, res.stderr))
    rows = [l.split("|")[1:-1] for l in open(os.path.join(out, "parting.md"))
            if l.startswith("| ") and not l.startswith("| run")]
    names = [r[0].strip() for r in rows]
    if names != ["stock", "mono1", "mono2", "cpu"]:
        fail("gpu-parting: runs %s in parting.md" % names)
    for r in rows:
        if r[1] != rows[0][1] or set(r[3].split()) != {"0"}:
            fail("gpu-parting: run %s differs from stock: %s" % (r[0].strip(), "|".join(r)))
    if len(os.listdir(out)) > 8:
        fail("gpu-parting: %d files in $OUT" % len(os.listdir(out)))
    import tarfile
    with tarfile.open(os.path.join(out, "parting_runs.tar")) as t:
        if len(t.getnames()) != 8:
            fail("gpu-parting: parting_runs.tar holds %s" % t.getnames())
    print("gpu-parting: 4 runs equal on the CPU, %d files out" % len(os.listdir(out)))


SASS_GOOD = """
\t\tFunction : _Z4goodv
        /*0000*/                   LDGSTS.E.BYPASS.128 [R13], desc[UR4][R8.64] ;   /* 0x0 */
        /*0010*/                   LDG.E.128 R4, desc[UR10][R2.64] ;               /* 0x0 */
"""
SASS_BAD = SASS_GOOD + """
\t\tFunction : _Z3badv
        /*0000*/                   LDGSTS.E.BYPASS.128 [R13+UR0], desc[UR1][R8.64] ;   /* 0x0 */
        /*0010*/              @!P1 LDGSTS.E.BYPASS.128 [R9+UR0], desc[UR1][R6.64] ;    /* 0x0 */
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;                    /* 0x0 */
"""


def check_sass_check(work):
    d = os.path.join(work, "sass_check")
    os.makedirs(d, exist_ok=True)
    tool = os.path.join(d, "cuobjdump")
    for name, text in (("good.txt", SASS_GOOD), ("bad.txt", SASS_BAD), ("none.txt", "")):
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
    with open(tool, "w") as f:  # cuobjdump -sass FILE: FILE holds the disassembly
        f.write('#!/bin/sh\ncat "$2"\n')
    os.chmod(tool, 0o755)
    env = dict(os.environ, CUOBJDUMP=tool, NVDISASM=tool)
    script = os.path.join(ROOT, "scripts", "sass_check.py")

    def run(name):
        r = subprocess.run([sys.executable, script, os.path.join(d, name)], env=env,
                           capture_output=True, text=True)
        return r.returncode, r.stdout + r.stderr

    rc, out = run("good.txt")
    if rc != 0 or "1 kernels" not in out:
        fail("sass_check on even descriptors: rc %d: %s" % (rc, out))
    rc, out = run("bad.txt")
    if rc != 1 or "_Z3badv: 2 instruction(s)" not in out or "_Z4goodv" in out:
        fail("sass_check on an odd descriptor: rc %d: %s" % (rc, out))
    rc, out = run("none.txt")
    if rc != 2:
        fail("sass_check on a file without kernels: rc %d: %s" % (rc, out))
    print("sass_check: even descriptors pass, odd ones fail by kernel, no kernels is an error")


def check_queue_sim(work):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import mono_queue_sim as q
    # two CTAs: both gate/up items end at 10, each CTA then takes a down
    # item at 10, polls (1) and works 5
    got = q.simulate([0.0, 0.0], [(0, 10.0), (0, 10.0)], [(0, 5.0), (0, 5.0)], 1.0)
    if got != (16.0, 10.0, 10.0):
        fail("mono_queue_sim: two CTAs: %r" % (got,))
    # three CTAs: the third ends expert 1's gate/up at 2 and takes its down
    # item (ends 6), then expert 0's, which waits for that expert's gate/up
    # to end (10): 10 + 1 + 5
    got = q.simulate([0.0] * 3, [(0, 10.0), (0, 10.0), (1, 2.0)], [(1, 3.0), (0, 5.0)], 1.0)
    if got != (16.0, 10.0, 2.0):
        fail("mono_queue_sim: three CTAs: %r" % (got,))
    # the presets against their traces (docs/PERF.md, thirty-sixth session)
    for rows, want in ((2, (123.7, 102.6, 74.7)), (4, (181.2, 157.7, 121.0))):
        got = q.simulate(*q.queues(q.PRESETS[rows]))
        if tuple(round(x, 1) for x in got) != want:
            fail("mono_queue_sim: %d rows: %r, want %r" % (rows, got, want))
    # a preset from a trace: CTA 0 ends the plan at 5 us, CTA 1 a router
    # item at 8; gate/up 10 us each; CTA 0's down item waits for the
    # gate/up (its wait is not a poll), CTA 1's is taken after it and
    # waits 1 us (the poll); both work 5
    path = os.path.join(work, "queue_trace.txt")
    with open(path, "w") as f:
        f.write("kernel kind cta item start end ready\n"
                "0 1 0 0 0 900 0\n"  # a pre kernel item: left out
                "1 11 0 10 0 5000 0\n1 4 1 9 0 8000 0\n"
                "1 6 0 20 5000 15000 0\n1 6 1 21 8000 18000 0\n"
                "1 8 0 30 15000 24000 19000\n1 8 1 31 19000 25000 20000\n")
    preset, seen = q.from_trace(path, 1)
    if preset != (2, 1, 2, 10.0, 2, 5.0, 1.0, [5.0, 8.0]) or seen != (25.0, 18.0, 15.0):
        fail("mono_queue_sim: from a trace: %r %r" % (preset, seen))
    got = q.simulate(*q.queues(preset))
    if got != (24.0, 18.0, 15.0):
        fail("mono_queue_sim: the trace's model: %r" % (got,))
    print("mono_queue_sim: hand-worked queues, the presets, a preset from a trace")


def check_perf_report(work):
    """Two points, stock and mono; --out a folder that does not exist yet."""
    import json
    pts = {"stock": (150.0, 300.0), "mono": (75.0, 200.0)}
    for path, (t1, t2) in pts.items():
        points = [dict(rows=1, context=4096, median_us=t1, bytes=200e6, floor_us=50.0,
                       read_us=55.0),
                  dict(rows=2, context=4096, median_us=t2, bytes=300e6, floor_us=100.0)]
        with open(os.path.join(work, "pr_%s.json" % path), "w") as f:
            json.dump({"read_gb_per_s": 4000.0, "points": points}, f)
    out = os.path.join(work, "pr_out", "nested")
    shutil.rmtree(os.path.join(work, "pr_out"), ignore_errors=True)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "perf_report.py"),
                        "--stock", os.path.join(work, "pr_stock.json"),
                        "--mono", os.path.join(work, "pr_mono.json"), "--out", out],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail("perf_report: exit %d: %s" % (r.returncode, r.stderr[-400:]))
    text = open(os.path.join(out, "results.md")).read()
    want = ["4000 GB/s", "| 1 | 4096 | 200.0 | 50.0 | 55.0 (1.10) | 150.0 (3.00) | 75.0 (1.50) |",
            "| 2 | 4096 | 300.0 | 100.0 | - | 300.0 (3.00) | 200.0 (2.00) |"]
    for w in want:
        if w not in text:
            fail("perf_report: %r not in results.md:\n%s" % (w, text))
    print("perf_report: the table from made-up JSON, its --out folder made")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m3")
    ap.add_argument("--work", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    check_mono_trace(args.work)
    check_queue_sim(args.work)
    check_gpu_ab(args.work)
    check_gpu_check(args.work)
    check_sass_check(args.work)
    check_perf_report(args.work)
    if args.m3:
        check_cuda_configs(os.path.abspath(args.m3), args.work, args.quick)
        check_gpu_parting(os.path.abspath(args.m3), args.work)
    print("test_tools: passed")


if __name__ == "__main__":
    main()
