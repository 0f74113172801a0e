"""Pipeline schedules as data: the ordered actions each stage runs, for the executor and the widget.

A schedule is one list of `Action`s per stage (pipeline rank). The executor in
`labsupport.parallel.pipeline_schedule` runs each list top to bottom with real send/recv, and
`labsupport.estimate.simulator` times the same lists, so the Gantt chart a learner sees is the
order that runs.

Conventions:

* Layout (Megatron-LM's interleaved layout). The model is cut into `stages * chunks` model
  chunks. Stage s, chunk c holds model chunk `c * stages + s`; with chunks=1, stage s holds
  model chunk s. Activations flow from model chunk k to k+1, gradients from k+1 to k. So forward
  sends go to stage (s+1) % stages (the last stage's chunk c feeds stage 0's chunk c+1) and
  backward sends to stage (s-1) % stages.
* The first model chunk (stage 0, chunk 0) reads the micro-batch itself: no RECV_F, no SEND_B.
  The last model chunk (stage p-1, chunk v-1) computes the loss: no SEND_F, no RECV_B.
* Every other F is preceded by its RECV_F and followed by its SEND_F; every other B is preceded
  by its RECV_B and followed by its SEND_B.
* Semantics: SEND is non-blocking (an isend; it completes when the peer receives), RECV blocks.
  Under these semantics every schedule here is deadlock-free, and on each channel (one pair of
  stages, one direction) the RECVs come in the same order as the peer's SENDs.

Schedules (p stages, m micro-batches, v chunks per stage):

* gpipe: all m forwards, then all m backwards (Huang et al. 2019, "GPipe", Sec 2.2), which
  keeps the activations of all m micro-batches alive. The backwards run in forward order (FIFO),
  as torch.distributed.pipelining's ScheduleGPipe and picotron's AFAB do: then GPipe and 1F1B
  differ only in when the backwards run, not in which order, and the bubble is the same either way.
* 1f1b: PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", Sec 2.2.1): stage s runs min(p - s - 1, m) warm-up
  forwards, then one forward and one backward in turn, then the remaining backwards. Same bubble
  as GPipe, but at most p - s micro-batches in flight instead of m.
* interleaved: interleaved 1F1B (Narayanan 2021, Sec 2.2.2; Megatron-LM's
  `forward_backward_pipelining_with_interleaving`): each stage holds v chunks and runs the m * v
  chunk-micro-batches in groups of p micro-batches per chunk; the bubble shrinks by v.
"""
from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One step of a stage: compute (F, B) or communicate (SEND_*, RECV_*) for one micro-batch.

    A named tuple rather than a dataclass: a schedule has millions of entries (64 stages x 6400
    micro-batches: 2.5 million) and the simulator compares them; tuples are made and compared
    several times faster.
    """

    op: str            # "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"
    microbatch: int
    chunk: int = 0     # the model chunk held by this stage (interleaved: v chunks per stage); 0..v-1


def model_chunk(stage: int, chunk: int, stages: int) -> int:
    """Which model chunk stage `stage` holds as its chunk `chunk` (Megatron's interleaved layout)."""
    return chunk * stages + stage


def check_schedule_args(name: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Raise ValueError with one clear line if `schedule(name, stages, microbatches, chunks)` cannot be built."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of: {', '.join(SCHEDULES)}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1 (got {stages})")
    if microbatches < 1:
        raise ValueError(f"micro-batches must be at least 1 (got {microbatches})")
    if name == "interleaved":
        if chunks < 2:
            raise ValueError(f"interleaved needs at least 2 chunks per stage (got {chunks}); "
                             "with 1 chunk use 1f1b")
        if stages < 2:
            raise ValueError("interleaved needs at least 2 stages")
        if microbatches % stages:
            raise ValueError(f"interleaved needs micro-batches divisible by stages ({microbatches} % {stages} != 0); "
                             f"try {-(-microbatches // stages) * stages}")
    elif chunks != 1:
        raise ValueError(f"{name} runs 1 chunk per stage (got {chunks}); use interleaved for more")


def schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """One ordered action list per stage (pipeline rank)."""
    check_schedule_args(name, stages, microbatches, chunks)
    order = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}[name]
    shared = SharedActions()
    return [with_communication(order(s, stages, microbatches, chunks), s, stages, chunks, shared)
            for s in range(stages)]


class SharedActions(dict):
    """One `Action` object per (op, microbatch, chunk), made on first use: `shared["F", 3, 0]`.

    Every stage runs the same actions (stage s's RECV_F of micro-batch 3 equals stage t's), so the
    stages' lists can hold references to one object each instead of p copies: for 64 stages and
    6400 micro-batches, 38,400 actions instead of 2.5 million, which is most of a schedule's memory.
    `runs` keeps, per kind of compute (the ops it runs, RECV, compute, SEND, and its chunk), the
    actions of each micro-batch, for the stages that compute that kind alike (a pipeline's middle ones).
    """

    def __init__(self):
        super().__init__()
        self.runs: dict[tuple, dict[int, tuple[Action, ...]]] = {}

    def __missing__(self, key: tuple[str, int, int]) -> Action:
        action = self[key] = Action(*key)
        return action


def peer(stage: int, action: Action, stages: int, chunks: int) -> tuple[int, Action]:
    """For a SEND/RECV action: the stage it talks to and the matching action there."""
    k = model_chunk(stage, action.chunk, stages)
    direction = {"SEND_F": 1, "RECV_B": 1, "RECV_F": -1, "SEND_B": -1}.get(action.op)
    if direction is None:
        raise ValueError(f"{action.op} is not a communication action")
    other = k + direction
    if not 0 <= other < stages * chunks:
        raise ValueError(f"stage {stage} chunk {action.chunk} holds model chunk {k}, which has no {action.op}")
    matching = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}[action.op]
    return other % stages, Action(matching, action.microbatch, other // stages)


# ---------------------------------------------------------------- compute orders (F and B only)

# Each is a list of (op, microbatch, chunk) triples, which `with_communication` turns into the
# shared Actions: plain tuples are made several times faster than named ones.
Triple = tuple[str, int, int]


def _gpipe(stage: int, stages: int, m: int, chunks: int) -> list[Triple]:
    return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]


def _one_f_one_b(stage: int, stages: int, m: int, chunks: int) -> list[Triple]:
    warmup = min(stages - stage - 1, m)
    order = [("F", j, 0) for j in range(warmup)]
    for j in range(m - warmup):                 # steady state: forward j + warmup, backward j
        order += (("F", j + warmup, 0), ("B", j, 0))
    order += [("B", j, 0) for j in range(m - warmup, m)]
    return order


def _interleaved(stage: int, stages: int, m: int, chunks: int) -> list[Triple]:
    """Megatron's order: chunk-micro-batch k is micro-batch (k // pv) p + k % p of chunk (k // p) % v.

    Forwards go through chunks 0..v-1, backwards through v-1..0, p micro-batches at a time. The
    warm-up is long enough for the first backward to arrive: (v - 1) p forwards to fill every
    chunk of the pipeline once, plus 2 (p - s - 1) for the round trip to the last stage and back.
    """
    p, v = stages, chunks
    total = m * v

    def microbatch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def forward(k: int) -> Triple:
        return "F", microbatch(k), (k // p) % v

    def backward(k: int) -> Triple:
        return "B", microbatch(k), v - 1 - (k // p) % v

    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += (forward(k + warmup), backward(k))
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def with_communication(order: list[Triple], stage: int, stages: int, chunks: int,
                       shared: SharedActions | None = None) -> list[Action]:
    """One stage's compute order (F and B only, as (op, microbatch, chunk)) with its communication:
    each RECV right before the compute that needs it, each SEND right after the compute.

    With non-blocking sends this cannot deadlock as long as the compute orders are consistent
    (every stage runs micro-batches through a chunk in the same order), which all schedules are.
    `shared` (one for all stages of a schedule) lets the stages' lists share their Action objects,
    and the stages that compute alike share the work of finding them (`SharedActions.runs`).
    """
    shared = SharedActions() if shared is None else shared
    first, last = 0, stages * chunks - 1
    kinds = {}              # (op, chunk) -> (the ops it runs: RECV, compute, SEND as they apply here, their runs)
    actions = []
    for op, microbatch, chunk in order:
        kind = kinds.get((op, chunk))
        if kind is None:                        # the same for every micro-batch: work it out once
            k = model_chunk(stage, chunk, stages)
            ops = tuple(o for o in ("RECV_" + op if k != (first if op == "F" else last) else None, op,
                                    "SEND_" + op if k != (last if op == "F" else first) else None) if o)
            kind = kinds[op, chunk] = ops, shared.runs.setdefault((ops, chunk), {})
        ops, runs = kind
        run = runs.get(microbatch)
        if run is None:
            run = runs[microbatch] = tuple(shared[o, microbatch, chunk] for o in ops)
        actions += run
    return actions
