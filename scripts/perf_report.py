#!/usr/bin/env python3
"""Turn the layer benchmark's JSON into the results table and plot of docs/PERF.md.

Inputs: `m3 bench layer --json` output (--stock, and later --mono: one file per
path; each has the measured read bandwidth and, per (rows, context), the time,
the bytes the step must read and the floor) and bench/torch_layer.py's JSON
(--torch: records per mode). Output in --out: results.md (a markdown table: per
point the floor, each path's time and time/floor) and perf.png (time/floor
against rows, one panel per context, a line per path). The floor of every
path is m3's byte count over the bandwidth measured in the same run; where
the JSON has it, the read-only column is one streaming kernel over the same
bytes (its ramp and tail in), the most any one-kernel step could do.
"""
import argparse
import json
import os
import sys


def load_m3(path, name):
    with open(path) as f:
        d = json.load(f)
    pts = {(p["rows"], p["context"]): p for p in d["points"]}
    return d["read_gb_per_s"], {name: pts}


def load_torch(path):
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        recs = json.load(f)
    out = {}
    for r in recs:
        out.setdefault("torch-" + r["mode"], {})[(r["rows"], r["context"])] = r
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock", required=True)
    ap.add_argument("--mono")
    ap.add_argument("--torch")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    bw, paths = load_m3(args.stock, "stock")
    if args.mono and os.path.exists(args.mono):
        paths.update(load_m3(args.mono, "mono")[1])
    paths.update(load_torch(args.torch))
    floors = {k: p["floor_us"] for k, p in paths["stock"].items()}
    names = list(paths)

    lines = [f"Read bandwidth measured in the run: {bw:.0f} GB/s. Times are medians of "
             "graph replays (torch-eager: of eager calls), in microseconds; "
             "(x) is time / floor.", "",
             "| rows | context | MB read | floor us | read-only us (x) | " +
             " | ".join(f"{n} us (x)" for n in names) + " |",
             "|" + "---|" * (5 + len(names))]
    for key in sorted(floors, key=lambda k: (k[1], k[0])):
        rows, ctx = key
        cells = []
        for n in names:
            p = paths[n].get(key)
            cells.append(f"{p['median_us']:.1f} ({p['median_us'] / floors[key]:.2f})"
                         if p else "-")
        mb = paths["stock"][key]["bytes"] / 1e6
        rd = paths["stock"][key].get("read_us")
        rd_cell = f"{rd:.1f} ({rd / floors[key]:.2f})" if rd else "-"
        lines.append(f"| {rows} | {ctx} | {mb:.1f} | {floors[key]:.1f} | {rd_cell} | " +
                     " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    print(text)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return 0
    contexts = sorted({k[1] for k in floors})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for n in names:
            pts = sorted((k[0], p["median_us"] / floors[k]) for k, p in paths[n].items()
                         if k[1] == ctx and k in floors)
            if pts:
                ax.plot([r for r, _ in pts], [x for _, x in pts], marker="o", label=n)
        ro = sorted((k[0], p["read_us"] / floors[k]) for k, p in paths["stock"].items()
                    if k[1] == ctx and p.get("read_us"))
        if ro:
            ax.plot([r for r, _ in ro], [x for _, x in ro], color="gray", linestyle="--",
                    label="read-only kernel")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # eager PyTorch is tens of times the floor
        ax.set_xlabel("rows")
        ax.set_ylabel("time / floor")
        ax.set_title(f"context {ctx}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "perf.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
