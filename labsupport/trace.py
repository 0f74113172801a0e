"""Arithmetic on a recorded step (trace-rank*.json): how much communication hid behind compute.

Plain Python on lists of events ({"op", "start", "end"} in seconds), no torch: the overlap
timeline widget and `metrics` (which the notebooks import it from) both use it.
"""
from __future__ import annotations


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def overlap(events: list[dict], compute=("backward",), comm_ops=("all_reduce",)) -> dict:
    """How much communication a step hid behind compute, from a recorded timeline (trace-rank*.json).

    hidden: time during which an all-reduce was in flight while backward was running;
    exposed: communication time with no compute beside it, which the step pays in full.
    """
    busy = _union([(e["start"], e["end"]) for e in events if e["op"] in compute])
    talk = _union([(e["start"], e["end"]) for e in events if e["op"] in comm_ops])
    hidden = _length(_union([(max(a, c), min(b, d)) for a, b in busy for c, d in talk if min(b, d) > max(a, c)]))
    return {"compute_s": _length(busy), "comm_s": _length(talk), "hidden_s": hidden,
            "exposed_s": _length(talk) - hidden}
