#!/usr/bin/env python3
"""A queue model of the mono post kernel's routed phase, to try item shapes without a GPU.

    scripts/mono_queue_sim.py [--rows 2|4 | --trace FILE --experts N]
                              [--egu-tail N --tail-us D] [--dn-us D] [--gu-us D]

The routed phase runs as the kernel runs it: every CTA takes the queue's next
item when it is free, the routed gate/up items first (expert by expert),
then the routed down items (expert by expert), and a down item starts only
once every gate/up item of its expert has ended, plus one poll. Each item
takes a fixed time (the trace's median work), whatever else runs: the
model knows nothing of DRAM's bandwidth being shared, so it says where
CTAs wait or idle for the queue's order and the items' sizes, not how fast
the weights stream. The presets are the thirty-sixth session's 4K traces
(docs/PERF.md): when the CTAs become free for the routed items (the plan's
end; the shared down items' CTAs later) and the items' times. Against
those traces it gives 2 rows: last gate/up end 102.6 us (trace 102.0),
first down item taken at 74.7 (74.1), end 123.7 (124.3); 4 rows: 157.7
(157.9), 121.0 (116.4), end 181.2 (190.9: the model's down items at the
end run faster than the real ones). Against that session's sweep at 2 rows it
gets larger gate/up items right (EGU_SUB=4 +1.4%, measured +1.0%) and larger
down items wrong (EDN_SUB=8 -2.8%, measured +1.8%): a change of the items'
sizes changes how fast each streams beside the others, which the model
leaves out. Use it for the queue's order and waits, not for item sizes.

--trace FILE --experts N builds the preset from an item trace of one
point (a file M3_MONO_TRACE wrote) instead, and prints the trace's own
times beside the model's. N is the step's distinct experts (n_uniq; on
m3-tp4-rank: the gate/up items over 192 / EGU_SUB tiles an expert), and
the trace must be of equal gate/up items (no M3_MONO_EGU_TAIL tail).

--egu-tail N gives the experts past those one wave of CTAs takes whole N
gate/up items each of --tail-us (M3_MONO_EGU_TAIL's shape); --dn-us and
--gu-us change the items' times (e.g. what a change to the items' own
overhead would give).
"""
import argparse
import heapq
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mono_trace import POST, median, read_rows, ready_of  # noqa: E402 (the trace's format)

# (CTAs, expert slots, gate/up items an expert, gate/up item us, down items
# an expert, down item us, poll us, CTA free times)
PRESETS = {
    2: (396, 8, 64, 27.9, 128, 9.5, 1.06,
        [46.8] * 268 + [60.4 + 0.1 * i for i in range(128)]),
    4: (396, 15, 48, 36.7, 96, 12.9, 1.12,
        [51.7] * 300 + [83.8 + 0.02 * i for i in range(96)]),
}


def simulate(free, gate_up, down, poll):
    """free: each CTA's first free time; gate_up / down: (expert, us) in
    queue order. Returns (end, last gate/up end, first down item's start),
    each down item's expert having at least one gate/up item."""
    heap = list(free)
    heapq.heapify(heap)
    ends = {}
    end = last_gu = 0.0
    for u, us in gate_up:
        t = heapq.heappop(heap) + us
        ends.setdefault(u, []).append(t)
        last_gu, end = max(last_gu, t), max(end, t)
        heapq.heappush(heap, t)
    first_dn = None
    for u, us in down:
        took = heapq.heappop(heap)  # (the trace's start of an item: before its wait)
        first_dn = took if first_dn is None else min(first_dn, took)
        t = max(took, max(ends[u])) + poll + us
        end = max(end, t)
        heapq.heappush(heap, t)
    return end, last_gu, first_dn


def queues(preset, gu_us=None, dn_us=None, egu_tail=0, tail_us=0.0):
    """A preset's queue for simulate: (free, gate_up, down, poll). gu_us /
    dn_us replace its items' times; egu_tail gives the experts past those
    one wave of CTAs takes whole egu_tail gate/up items of tail_us each."""
    P, nu, gpe, p_gu, dpe, p_dn, poll, free = preset
    gu_us = p_gu if gu_us is None else gu_us
    dn_us = p_dn if dn_us is None else dn_us
    whole = min(nu, P // gpe) if egu_tail else nu
    gate_up = []
    for u in range(nu):
        gate_up += [(u, gu_us)] * gpe if u < whole else [(u, tail_us)] * egu_tail
    return free, gate_up, [(u, dn_us) for u in range(nu) for _ in range(dpe)], poll


def from_trace(path, experts):
    """A preset from an item trace (M3_MONO_TRACE's file for one point) of
    a step with `experts` expert slots: the post kernel's CTAs, each free
    for the routed items at the later of the plan's end and the end of its
    last other item (shared down items after the routed gate/up, which
    M3_MONO_SHDN_EARLY below 100 queues, are not modelled); the routed
    items' median work; as the poll, the median wait of the down items
    taken after their expert's gate/up had ended. Returns (preset, the
    trace's (end, last gate/up end, first down item's start)), times in us
    from the kernel's first item."""
    EGU, EDN, PLAN = (POST.index(k) for k in ("expert_gu", "expert_down", "plan"))
    rows = [r for r in read_rows(path) if r[0] == 1]
    if not rows:
        raise SystemExit("mono_queue_sim: no post kernel items in %s" % path)
    t0 = min(r[4] for r in rows)
    us = lambda ns: (ns - t0) / 1e3
    gu = sorted(r for r in rows if r[1] == EGU)
    dn = sorted(r for r in rows if r[1] == EDN)
    if not gu or not dn or len(gu) % experts or len(dn) % experts:
        raise SystemExit("mono_queue_sim: %d gate/up and %d down items do not split over %d "
                         "experts" % (len(gu), len(dn), experts))
    plan_end = max((us(r[5]) for r in rows if r[1] == PLAN), default=0.0)
    free = {}
    for r in rows:
        if r[1] not in (EGU, EDN):
            free[r[2]] = max(free.get(r[2], plan_end), us(r[5]))
    free = [free.get(c, plan_end) for c in {r[2] for r in rows}]

    med = lambda v: median(sorted(v))
    gpe, dpe = len(gu) // experts, len(dn) // experts
    # the poll: the wait of down items taken after their expert's last
    # gate/up item had ended (the queue is expert by expert, by item index)
    gu_end = [max(r[5] for r in gu[u * gpe:(u + 1) * gpe]) for u in range(experts)]
    polls = [(ready_of(r) - r[4]) / 1e3 for i, r in enumerate(dn) if r[4] >= gu_end[i // dpe]]
    preset = (len(free), experts, gpe, med((r[5] - ready_of(r)) / 1e3 for r in gu),
              dpe, med((r[5] - ready_of(r)) / 1e3 for r in dn), med(polls) if polls else 0.0,
              sorted(free))
    seen = (max(us(r[5]) for r in rows), max(us(r[5]) for r in gu), min(us(r[4]) for r in dn))
    return preset, seen


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, choices=sorted(PRESETS), default=2)
    ap.add_argument("--trace", help="a preset from this item trace instead (needs --experts)")
    ap.add_argument("--experts", type=int, help="the traced step's expert slots (n_uniq)")
    ap.add_argument("--egu-tail", type=int, default=0, help="gate/up items a tail expert")
    ap.add_argument("--tail-us", type=float, default=0.0, help="a tail item's time")
    ap.add_argument("--gu-us", type=float, help="a gate/up item's time (preset's)")
    ap.add_argument("--dn-us", type=float, help="a down item's time (preset's)")
    args = ap.parse_args()
    if args.trace:
        if not args.experts or args.experts < 1:
            ap.error("--trace needs --experts N (the step's distinct experts)")
        preset, seen = from_trace(args.trace, args.experts)
        print("trace: end %.1f us, last gate/up end %.1f, first down item taken %.1f" % seen)
    else:
        preset = PRESETS[args.rows]
    if args.egu_tail and args.tail_us <= 0:
        ap.error("--egu-tail needs --tail-us")
    end, last_gu, first_dn = simulate(*queues(preset, args.gu_us, args.dn_us, args.egu_tail,
                                              args.tail_us))
    print("model: end %.1f us, last gate/up end %.1f, first down item taken %.1f"
          % (end, last_gu, first_dn))


if __name__ == "__main__":
    main()
