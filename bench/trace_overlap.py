#!/usr/bin/env python3
"""Share of asynchronous collective time hidden behind compute, from a Chrome trace
written by `tessera train --trace` (one rank's file).

Collectives issued by DataParallel run on the communicator's worker thread as
"comm_async" spans; compute is the training thread's "forward_backward" spans (gradient
buckets are only reduced during backward). Hidden = time of comm_async spans that falls
inside some forward_backward span; exposed = the rest (the optimizer waits for it in
"grad_sync_wait"). Usage: trace_overlap.py TRACE.json [--skip-steps K]
"""
import json
import sys


def intervals(events, name):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == name and e.get("ph") == "X")


def overlap(a, b):
    """Total length of the intersection of interval lists a and b (each sorted, b disjoint)."""
    total, j = 0.0, 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            total += max(0.0, min(e, b[k][1]) - max(s, b[k][0]))
            k += 1
    return total


def main():
    path = sys.argv[1]
    skip = int(sys.argv[sys.argv.index("--skip-steps") + 1]) if "--skip-steps" in sys.argv else 2
    doc = json.load(open(path))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    steps = intervals(events, "step")
    start = steps[skip][0] if len(steps) > skip else 0  # leave out warm-up steps
    keep = lambda iv: [x for x in iv if x[0] >= start]
    comm = keep(intervals(events, "comm_async"))
    compute = keep(intervals(events, "forward_backward"))
    wait = keep(intervals(events, "grad_sync_wait"))
    c = sum(e - s for s, e in comm)
    hidden = overlap(comm, compute)
    print(json.dumps({
        "steps": max(0, len(steps) - skip),
        "comm_ms": round(c / 1e3, 3),
        "hidden_ms": round(hidden / 1e3, 3),
        "hidden_share": round(hidden / c, 4) if c else None,
        "grad_sync_wait_ms": round(sum(e - s for s, e in wait) / 1e3, 3),
        "forward_backward_ms": round(sum(e - s for s, e in compute) / 1e3, 3),
    }))


if __name__ == "__main__":
    main()
