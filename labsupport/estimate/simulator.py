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

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import cached_property

from .schedules import Action, peer


class ScheduleError(RuntimeError):
    """The action lists deadlock, receive the wrong message, or leave a message unreceived."""


# (start_s, end_s, op, microbatch, chunk): the format the executor records for a real run.
Span = tuple[float, float, str, int, int]


@dataclass(frozen=True)
class Timeline:
    """Per stage, the compute actions with their start and end times; and what follows from them.

    The figures below are worked out on first use and kept (a timeline of 64 stages x 1600
    micro-batches has 200,000 spans): a Timeline is not meant to change after `simulate` made it.
    """

    spans: list[list[Span]]
    peak_inflight_microbatches: list[int]   # per stage: most chunk forwards whose backward has not run

    @cached_property
    def total_time(self) -> float:
        """The makespan: from the first forward to the last backward on any stage (a stage's spans
        are in time order: its last ends last)."""
        return max((stage[-1][1] for stage in self.spans if stage), default=0.0)

    @cached_property
    def busy(self) -> list[float]:
        return [sum(end - start for start, end, *_ in stage) for stage in self.spans]

    @cached_property
    def idle(self) -> list[float]:
        total = self.total_time
        return [total - b for b in self.busy]

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

    def to_json(self, timeline: bool = False) -> dict:
        """The figures, per stage and overall, ready for `json.dumps`; with `timeline`, every span too
        (as an array: 200,000 of them for 64 stages x 1600 micro-batches, most of the time and the
        6 MB of such a JSON, so only on request)."""
        figures = dict(bubble_fraction=self.bubble_fraction, bubble_over_ideal=self.bubble_over_ideal,
                       peak_inflight_microbatches=self.peak_inflight_microbatches, total_time=self.total_time,
                       busy=self.busy, idle=self.idle)
        return {**figures, "timeline": [list(stage) for stage in self.spans]} if timeline else figures


def simulate(actions_per_stage: list[list[Action]], forward_time: float = 1.0, backward_ratio: float = 2.0,
             p2p_time: float = 0.0, chunks: int = 1) -> Timeline:
    """Start every action as early as its stage and its messages allow; see the module docstring."""
    duration = {"F": forward_time / chunks, "B": forward_time * backward_ratio / chunks}
    spans = _run(actions_per_stage, len(actions_per_stage), chunks, duration, p2p_time, blocking_sends=False)
    return Timeline(spans, [_peak_inflight(stage) for stage in actions_per_stage])


def check_happens_before(actions_per_stage: list[list[Action]], stages: int, chunks: int,
                         blocking_sends: bool = False) -> None:
    """Raise ScheduleError unless every RECV gets its SEND, in channel order, and nothing deadlocks.

    blocking_sends=True makes a SEND wait until the peer is at the matching RECV (a plain,
    unbuffered `send`), which is when "both neighbours send first" deadlocks.
    """
    if len(actions_per_stage) != stages:
        raise ScheduleError(f"{len(actions_per_stage)} action lists for {stages} stages")
    _run(actions_per_stage, stages, chunks, {"F": 0.0, "B": 0.0}, 0.0, blocking_sends)


def _run(actions_per_stage, stages, chunks, duration, p2p_time, blocking_sends) -> list[list[Span]]:
    """Round after round, each stage in turn runs as far as it can, until none can move. Returns
    each stage's compute spans.

    Each channel (sender, receiver) is a FIFO queue of (the RECV it must meet, arrival time), as
    torch.distributed matches messages between two ranks in the order they were posted. The
    times are right whatever order the stages run in: a stage's clock depends only on its own
    previous action and on when its messages arrive.

    A stage that must wait is not looked at again until the stage it waits for has moved, so the
    work grows with the actions, not with rounds x stages: each action runs once, and each move
    wakes at most the few stages waiting for it (a stage's two neighbours, in every schedule here).
    What an action needs of its peer is looked up once per (op, chunk) and stage (`_Routes`), not
    per micro-batch: the 1T run's pipeline has 600,000 actions.
    """
    pc = [0] * stages
    clock = [0.0] * stages
    spans: list[list[Span]] = [[] for _ in range(stages)]
    channels: dict[tuple[int, int], deque] = defaultdict(deque)
    routes = [_Routes(stage, stages, chunks, channels) for stage in range(stages)]
    waiting = [[] for _ in range(stages)]       # waiting[x]: the stages stuck until stage x moves
    this_round = list(range(stages))            # the stages still to look at in this round, lowest first (a heap)
    next_round: list[int] = []
    running = 0

    def current(stage: int) -> Action | None:
        return actions_per_stage[stage][pc[stage]] if pc[stage] < len(actions_per_stage[stage]) else None

    def moved(stage: int) -> None:
        """Wake the stages waiting for `stage`: in this round if their turn is still to come, else the next."""
        for other in waiting[stage]:
            heapq.heappush(this_round if other > running else next_round, other)
        waiting[stage].clear()

    def advance(stage: int) -> int | None:
        """Run the stage's actions until one must wait; return the stage it waits for (None: done)."""
        actions, i, now = actions_per_stage[stage], pc[stage], clock[stage]
        route, record = routes[stage], spans[stage].append
        n = len(actions)
        while i < n:
            action = actions[i]
            op, microbatch, chunk = action
            took = duration.get(op)
            if took is not None:                                     # F or B
                end = now + took
                record((now, end, op, microbatch, chunk))
                now = end
                i += 1
                continue
            other, matching, its_chunk, queue = route[op, chunk]
            if op in SENDS:
                expected = (matching, microbatch, its_chunk)    # the RECV it must meet (a tuple equals an Action)
                if not blocking_sends:
                    queue.append((expected, now + p2p_time))
                else:                                           # rendezvous with the receiver's RECV
                    there = current(other)
                    if (other == stage or there is None or not there.op.startswith("RECV")
                            or routes[other][there.op, there.chunk][0] != stage):
                        break
                    if there != expected:
                        raise _out_of_order(other, there, expected, stage)
                    now = clock[other] = max(now, clock[other]) + p2p_time
                    pc[other] += 1
                    moved(other)
            else:                                               # a RECV: its message must be there
                if not queue:
                    break
                expected, arrival = queue.popleft()
                if action != expected:
                    raise _out_of_order(stage, action, expected, other)
                if arrival > now:
                    now = arrival
            i += 1
        if i > pc[stage]:
            pc[stage], clock[stage] = i, now
            moved(stage)
        return route[actions[i].op, actions[i].chunk][0] if i < n else None

    while this_round:
        running = heapq.heappop(this_round)
        other = advance(running)
        if other is not None:
            waiting[other].append(running)
        if not this_round:
            this_round, next_round = next_round, []

    def waiting_at(stage: int) -> str:
        action = current(stage)
        sends = action.op.startswith("SEND")
        other = peer(stage, action, stages, chunks)[0]
        gone = f", which has finished: no matching {'RECV' if sends else 'SEND'}" if current(other) is None else ""
        return f"stage {stage} at {_describe(action)} ({'to' if sends else 'from'} stage {other}{gone})"

    stuck = [s for s in range(stages) if current(s) is not None]
    if stuck:
        raise ScheduleError(f"deadlock: {'; '.join(waiting_at(s) for s in stuck)}")
    unreceived = [f"{_describe(a)} on stage {dst} from stage {src}"
                  for (src, dst), queue in channels.items() for a, _ in queue]
    if unreceived:
        raise ScheduleError(f"sent but never received: {'; '.join(unreceived)}")
    return spans


SENDS = ("SEND_F", "SEND_B")


class _Routes(dict):
    """One stage's `peer`s without the micro-batch, worked out on first use and kept (they are the same
    for every micro-batch): `routes[op, chunk]` is (the other stage, the matching op there, its chunk,
    the queue of the channel between them, this stage's to send on or the other's to receive from)."""

    def __init__(self, stage: int, stages: int, chunks: int, channels: dict[tuple[int, int], deque]):
        super().__init__()
        self.stage, self.stages, self.chunks, self.channels = stage, stages, chunks, channels

    def __missing__(self, key: tuple[str, int]) -> tuple[int, str, int, deque]:
        op, chunk = key
        other, matching = peer(self.stage, Action(op, 0, chunk), self.stages, self.chunks)
        queue = self.channels[(self.stage, other) if op in SENDS else (other, self.stage)]
        self[key] = other, matching.op, matching.chunk, queue
        return self[key]


def _out_of_order(stage: int, action: Action, expected: tuple[str, int, int], src: int) -> ScheduleError:
    return ScheduleError(f"stage {stage} posts {_describe(action)} but the next message from stage {src} "
                         f"is for {_describe(expected)}: receives out of send order")


def _describe(action: tuple[str, int, int]) -> str:
    op, microbatch, chunk = action
    return f"{op}(micro-batch {microbatch}, chunk {chunk})"


def _peak_inflight(actions: list[Action]) -> int:
    """Most forwards done whose backward has not run yet: the activations a stage holds at once."""
    inflight = peak = 0
    for a in actions:
        if a.op == "F":
            inflight += 1
            peak = max(peak, inflight)
        elif a.op == "B":
            inflight -= 1
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
