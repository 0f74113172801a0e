"""Time a pipeline schedule: when each stage computes, how long it idles, how much it keeps alive.

`simulate` runs the action lists of `schedules.schedule` with the executor's semantics (SEND
non-blocking, RECV blocking) on an idealised machine: a chunk's forward takes forward_time / v,
its backward backward_ratio times that, a message arrives p2p_time after it was sent, nothing
else costs time. `check_happens_before` runs the same lists without times and says whether they
can deadlock or mismatch a message, also under blocking sends (the classic bug: two neighbours
that both send first). The formulas the simulation must reproduce are `bubble_over_ideal` and
`bubble_fraction` at the bottom.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from .schedules import Action, peer


class ScheduleError(RuntimeError):
    """The action lists deadlock, receive the wrong message, or leave a message unreceived."""


# (start_s, end_s, op, microbatch, chunk): the format the executor records for a real run.
Span = tuple[float, float, str, int, int]


@dataclass(frozen=True)
class Timeline:
    """Per stage, the compute actions with their start and end times; and what follows from them."""

    spans: list[list[Span]]
    peak_inflight_microbatches: list[int]   # per stage: most chunk forwards whose backward has not run

    @property
    def total_time(self) -> float:
        """The makespan: from the first forward to the last backward on any stage."""
        return max((s[1] for stage in self.spans for s in stage), default=0.0)

    @property
    def busy(self) -> list[float]:
        return [sum(end - start for start, end, *_ in stage) for stage in self.spans]

    @property
    def idle(self) -> list[float]:
        return [self.total_time - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Idle / total time, over all stages (equal on every stage when messages are free)."""
        total = self.total_time * len(self.spans)
        return sum(self.idle) / total if total else 0.0

    @property
    def bubble_over_ideal(self) -> float:
        """Idle / busy time: Narayanan's "bubble time fraction" t_pb / t_id."""
        busy = sum(self.busy)
        return sum(self.idle) / busy if busy else 0.0

    def to_json(self) -> dict:
        return dict(bubble_fraction=self.bubble_fraction, bubble_over_ideal=self.bubble_over_ideal,
                    peak_inflight_microbatches=self.peak_inflight_microbatches,
                    total_time=self.total_time, timeline=[[list(s) for s in stage] for stage in self.spans])


def simulate(actions_per_stage: list[list[Action]], forward_time: float = 1.0, backward_ratio: float = 2.0,
             p2p_time: float = 0.0, chunks: int = 1) -> Timeline:
    """Start every action as early as its stage and its messages allow; see the module docstring."""
    stages = len(actions_per_stage)
    step = {"F": forward_time / chunks, "B": forward_time * backward_ratio / chunks}
    spans: list[list[Span]] = [[] for _ in range(stages)]

    def compute(stage: int, action: Action, clock: float) -> float:
        end = clock + step[action.op]
        spans[stage].append((clock, end, action.op, action.microbatch, action.chunk))
        return end

    _run(actions_per_stage, stages, chunks, compute, p2p_time, blocking_sends=False)
    return Timeline(spans, [_peak_inflight(stage) for stage in actions_per_stage])


def check_happens_before(actions_per_stage: list[list[Action]], stages: int, chunks: int,
                         blocking_sends: bool = False) -> None:
    """Raise ScheduleError unless every RECV gets its SEND, in channel order, and nothing deadlocks.

    blocking_sends=True makes a SEND wait until the peer is at the matching RECV (a plain,
    unbuffered `send`), which is when "both neighbours send first" deadlocks.
    """
    if len(actions_per_stage) != stages:
        raise ScheduleError(f"{len(actions_per_stage)} action lists for {stages} stages")
    _run(actions_per_stage, stages, chunks, lambda stage, action, clock: clock, 0.0, blocking_sends)


def _run(actions_per_stage, stages, chunks, compute, p2p_time, blocking_sends) -> None:
    """Advance every stage as far as it can, round after round, until all are done or none can move.

    Each channel (sender, receiver) is a FIFO queue of (the RECV it must meet, arrival time), as
    torch.distributed matches messages between two ranks in the order they were posted. The
    times are right whatever the round order: a stage's clock depends only on its own previous
    action and on when its messages arrive.
    """
    pc = [0] * stages
    clock = [0.0] * stages
    channels: dict[tuple[int, int], deque] = defaultdict(deque)

    def current(stage: int) -> Action | None:
        return actions_per_stage[stage][pc[stage]] if pc[stage] < len(actions_per_stage[stage]) else None

    def advance(stage: int) -> bool:
        action = current(stage)
        if action is None:
            return False
        if action.op in ("F", "B"):
            clock[stage] = compute(stage, action, clock[stage])
        elif action.op.startswith("SEND"):
            dst, expected = peer(stage, action, stages, chunks)
            if not blocking_sends:
                channels[stage, dst].append((expected, clock[stage] + p2p_time))
            else:                                       # rendezvous with the receiver's RECV
                there = current(dst)
                if (dst == stage or there is None or not there.op.startswith("RECV")
                        or peer(dst, there, stages, chunks)[0] != stage):
                    return False
                _match(dst, there, expected, stage)
                clock[stage] = clock[dst] = max(clock[stage], clock[dst]) + p2p_time
                pc[dst] += 1
        else:
            src, _ = peer(stage, action, stages, chunks)
            if not channels[src, stage]:
                return False
            expected, arrival = channels[src, stage].popleft()
            _match(stage, action, expected, src)
            clock[stage] = max(clock[stage], arrival)
        pc[stage] += 1
        return True

    moved = True
    while moved:
        moved = False
        for stage in range(stages):
            while advance(stage):
                moved = True

    def waiting(stage: int) -> str:
        action = current(stage)
        sends = action.op.startswith("SEND")
        other = peer(stage, action, stages, chunks)[0]
        gone = f", which has finished: no matching {'RECV' if sends else 'SEND'}" if current(other) is None else ""
        return f"stage {stage} at {_describe(action)} ({'to' if sends else 'from'} stage {other}{gone})"

    stuck = [s for s in range(stages) if current(s) is not None]
    if stuck:
        raise ScheduleError(f"deadlock: {'; '.join(waiting(s) for s in stuck)}")
    unreceived = [f"{_describe(a)} on stage {dst} from stage {src}"
                  for (src, dst), queue in channels.items() for a, _ in queue]
    if unreceived:
        raise ScheduleError(f"sent but never received: {'; '.join(unreceived)}")


def _match(stage: int, action: Action, expected: Action, src: int) -> None:
    if action != expected:
        raise ScheduleError(f"stage {stage} posts {_describe(action)} but the next message from stage {src} "
                            f"is for {_describe(expected)}: receives out of send order")


def _describe(action: Action) -> str:
    return f"{action.op}(micro-batch {action.microbatch}, chunk {action.chunk})"


def _peak_inflight(actions: list[Action]) -> int:
    """Most forwards done whose backward has not run yet: the activations a stage holds at once."""
    inflight = peak = 0
    for a in actions:
        inflight += {"F": 1, "B": -1}.get(a.op, 0)
        peak = max(peak, inflight)
    return peak


# ---------------------------------------------------------------- the formulas the simulation meets

def bubble_over_ideal(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p - 1) / (v m): pipeline bubble time over ideal compute time.

    Narayanan et al. 2021, Sec 2.2.1: t_pb / t_id = (p - 1) / m for GPipe and 1F1B; Sec 2.2.2:
    (p - 1) / (v m) for the interleaved schedule with v chunks per stage. Exact when messages
    are free and every stage costs the same.
    """
    return (stages - 1) / (chunks * microbatches)


def bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """(p - 1) / (v m + p - 1): the share of a stage's time spent idle.

    Huang et al. 2019 ("GPipe", Sec 2.3) give the bubble overhead as O((K - 1) / (M + K - 1)) for
    K partitions and M micro-batches; it is bubble_over_ideal / (1 + bubble_over_ideal).
    """
    return (stages - 1) / (chunks * microbatches + stages - 1)
