#!/usr/bin/env python3
"""Where a step goes: a Chrome trace of `tessera bench train --trace FILE` (or `tessera train
--trace`) summed by span name, as self time (a span's duration less the spans nested in it on
the same thread), per step. "untraced" is the step time no kernel span covers (glue code,
allocation, copies that are not kernels).

    bench/trace_summary.py TRACE.json [--step-name train_step]
"""
import argparse
import collections
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--step-name", default="train_step")
    args = ap.parse_args()
    try:
        with open(args.trace) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"trace_summary: {args.trace}: {e}")
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if e["name"] == args.step_name]
    if not steps:
        sys.exit(f"trace_summary: {args.trace} has no '{args.step_name}' spans")
    by_thread = collections.defaultdict(list)
    for e in spans:
        by_thread[e.get("tid", 0)].append(e)
    self_us = collections.Counter()
    calls = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [event, child time]
        def close(item):
            ev, child = item
            self_us[ev["name"]] += ev["dur"] - child
            calls[ev["name"]] += 1
            if stack:
                stack[-1][1] += ev["dur"]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                close(stack.pop())
            stack.append([e, 0])
        while stack:
            close(stack.pop())
    n = len(steps)
    step_ms = sum(s["dur"] for s in steps) / n / 1e3
    print(f"{n} steps, mean {step_ms:.1f} ms")
    rows = [(name, us / n / 1e3, calls[name] / n) for name, us in self_us.items()]
    rows.sort(key=lambda r: -r[1])
    print(f"{'span':<28}{'ms/step':>10}{'share':>8}{'calls/step':>12}")
    for name, ms, c in rows:
        label = "untraced" if name == args.step_name else name
        print(f"{label:<28}{ms:>10.2f}{ms / step_ms:>8.1%}{c:>12.1f}")


if __name__ == "__main__":
    main()
