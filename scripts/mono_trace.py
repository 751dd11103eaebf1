#!/usr/bin/env python3
"""Summarise a mono-kernel item trace (M3_MONO_TRACE=prefix m3 bench layer --path mono).

Per kernel and item kind: how many items, when the first started and the
last ended (µs from the kernel's first item), the summed busy time, the
median item time, and of it the median time spent waiting for the item's
inputs (a counter) and working after they were ready, and the median work
of a CTA's first item of the kind against its later ones ("1st / again":
the first runs the kind's code cold on its SM and starts with every other
CTA's first item at once). The gaps between kinds are where CTAs waited.
With both kernels in the trace, the time between the pre kernel's last
item and the post kernel's first (the launch and the prologues, which no
item holds) and the two kernels' span.
Older traces without the ready column show no split. Traces of a build
with -DM3_MONO_MARKS have up to six mark columns (times inside each item:
each GEMV chunk's activations staged and, from 2026-12-01's fourteenth
session, warp 0's products of it done; a routed down item's
activations staged (from the thirty-first session), its outputs written,
its combine arrival; from the thirty-seventh, a shared down item's
activations staged, its outputs written, its combine arrival; from the thirty-second session, a norm's
(norm1, norm2) copies landed, its sum of squares, its rows written;
the selection's scores staged, its threshold, its ids compacted):
their medians, in µs after the item's
inputs were ready, are printed under each kind, for all items and split
into CTAs' first items of the kind and their later ones.
"""
import sys
from collections import defaultdict

PRE = ["norm1", "proj", "index", "norm1_again", "rope"]  # norm1_again: traces before 2026-12-01
POST = ["select", "attention", "o_proj", "norm2", "router", "shared_gu", "expert_gu",
        "shared_down", "expert_down", "final", "merge", "plan", "dry"]


def median(v):
    return v[len(v) // 2]


def read_rows(path):
    """A trace's item rows, each a list of ints: kernel kind cta item start
    end [ready [marks...]] (ns; the header line left out)."""
    return [list(map(int, l.split())) for l in open(path).read().splitlines()[1:] if l.strip()]


def ready_of(r):
    """An item row's inputs-ready time: 0 (no wait) or a time before the
    item's start counts as no wait."""
    return min(max(r[6] if len(r) > 6 else 0, r[4]), r[5])


def main(path):
    rows = read_rows(path)
    by = defaultdict(list)
    for r in rows:
        k, kind, cta, item, t0, t1 = r[:6]
        ready = ready_of(r)
        marks = [m - ready if m else None for m in r[7:]]
        by[(k, kind)].append((t0, t1, cta, ready, item, marks))
    # per CTA, in start order: is this the CTA's first item of its kind?
    first = {}
    seen = set()
    for r in sorted(rows, key=lambda r: r[4]):
        key = (r[0], r[1], r[2])
        first[(r[0], r[2], r[3], r[4])] = key not in seen
        seen.add(key)
    print(path)
    spans = {}
    for k in (0, 1):
        ks = [v for (kk, _), v in by.items() if kk == k]
        if not ks:
            continue
        start = min(x[0] for v in ks for x in v)
        end = max(x[1] for v in ks for x in v)
        ctas = len({x[2] for v in ks for x in v})
        spans[k] = (start, end)
        print("  %s kernel: %.1f us from first item to last, %d CTAs took items" %
              ("pre" if k == 0 else "post", (end - start) / 1e3, ctas))
        names = PRE if k == 0 else POST
        for kind in sorted(kind for kk, kind in by if kk == k):
            v = by[(k, kind)]
            d = sorted(x[1] - x[0] for x in v)
            wait = sorted(x[3] - x[0] for x in v)
            work = sorted(x[1] - x[3] for x in v)
            w1 = sorted(x[1] - x[3] for x in v if first[(k, x[2], x[4], x[0])])
            w2 = sorted(x[1] - x[3] for x in v if not first[(k, x[2], x[4], x[0])])
            split = "  1st / again %6.2f / %s" % (
                median(w1) / 1e3, "%6.2f" % (median(w2) / 1e3) if w2 else "     -")
            print("    %-12s n=%5d  first %8.1f  last end %8.1f  busy %9.1f  median %7.2f "
                  "(wait %6.2f, work %6.2f)  max %7.2f us%s" %
                  (names[kind] if kind < len(names) else kind, len(v),
                   (min(x[0] for x in v) - start) / 1e3,
                   (max(x[1] for x in v) - start) / 1e3,
                   sum(d) / 1e3, median(d) / 1e3, median(wait) / 1e3,
                   median(work) / 1e3, d[-1] / 1e3, split))
            nm = max(len(x[5]) for x in v)
            # medians of all items, then of CTAs' first items of the kind and
            # of their later ones (cold code shows as a first-item-only cost)
            for label, sel in (("", lambda x: True),
                               (" 1st", lambda x: first[(k, x[2], x[4], x[0])]),
                               (" again", lambda x: not first[(k, x[2], x[4], x[0])])):
                cols = [sorted(x[5][j] for x in v
                               if sel(x) and j < len(x[5]) and x[5][j] is not None)
                        for j in range(nm)]
                if any(cols):
                    print("        marks after ready%s: " % label + " ".join(
                        "%.2f (n=%d)" % (median(c) / 1e3, len(c)) if c else "-" for c in cols))
    if len(spans) == 2:
        # one clock (the global timer) for both launches: the time between
        # them is the pre kernel's exit, the post kernel's launch and its
        # prologue, which no item's time holds
        (s0, e0), (s1, e1) = spans[0], spans[1]
        print("  between kernels: the post kernel's first item started %.1f us after the pre "
              "kernel's last item ended; %.1f us from the first item to the last" %
              ((s1 - e0) / 1e3, (max(e0, e1) - min(s0, s1)) / 1e3))


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
