"""Notebook 05's exercises: one stage's 1F1B compute order (graded by the schedule simulator and its
happens-before check, then run for real by the pipeline executor on two ranks), and a find-the-bug
lab (1F1B's action lists run by an executor whose sends block: on two stages the run hangs, each
stage waiting for the other).

The local checks use `labsupport.estimate`: the same action lists the executor runs, timed by the
simulator and checked for deadlocks by `check_happens_before`. The check on ranks hands the
attendee's lists to the real executor (`labsupport.parallel.pipeline_schedule.PipelineSchedule`) in place
of the library's schedule, and compares every gradient with the dense model's.
"""
from __future__ import annotations

import re

from . import on_ranks
from .exercise import Exercise, Unsolved, Wrong, attempt, paragraphs, register

RANKS = 2
HANG = "A stage's RECV must meet the neighbour's SEND of the same message, in the order they were sent"
ONE_F_ONE_B_CASES = ((4, 8), (2, 4), (4, 2), (3, 5))        # (stages p, micro-batches m); m < p on purpose
BLOCKING_CASES = (2, 4, 8)                                  # micro-batches on two stages


def _actions(got, what: str) -> list:
    """The attendee's list as Actions; ("F", 0) pairs are accepted too."""
    from ..estimate.schedules import Action
    if not isinstance(got, (list, tuple)):
        raise Wrong(f"{what} should return a list of actions, it returned {type(got).__name__}")
    out = []
    for a in got:
        if isinstance(a, Action):
            out.append(a)
        elif isinstance(a, (list, tuple)) and len(a) in (2, 3) and isinstance(a[0], str):
            out.append(Action(*a))
        else:
            raise Wrong(f"{what} returned {a!r} in its list; each entry is Action(op, microbatch), op \"F\" or \"B\"")
    return out



def side_of(value: float, reference: float, tolerance: float = 0.05) -> str:
    """"above", "equal" (within `tolerance` of `reference`, relative) or "below": the answer of a prediction
    that compares a measurement with a formula, computed so that no cell has to spell it out."""
    if abs(value - reference) <= tolerance * abs(reference):
        return "equal"
    return "above" if value > reference else "below"


def _describe(a) -> str:
    return f"{a.op}{a.microbatch}"


def _order(actions) -> str:
    shown = " ".join(_describe(a) for a in actions[:14])
    return shown + (" ..." if len(actions) > 14 else "")


# ---------------------------------------------------------------- one stage's 1F1B order

def reference_order(stage: int, stages: int, microbatches: int) -> list:
    """The compute actions (F and B) of the library's 1F1B on this stage, in order."""
    from ..estimate.schedules import schedule
    return [a for a in schedule("1f1b", stages, microbatches)[stage] if a.op in ("F", "B")]


def attendee_schedule(fn, stages: int, microbatches: int) -> list[list]:
    """Every stage's full action list: the attendee's compute order with the sends and receives
    placed around it as `estimate.schedules` places them (each RECV right before its compute,
    each SEND right after)."""
    from ..estimate.schedules import with_communication
    return [with_communication(_compute_order(fn, s, stages, microbatches), s, stages, 1) for s in range(stages)]


def _compute_order(fn, stage, stages, m) -> list:
    try:
        got = attempt(fn, stage, stages, m)
    except (Wrong, Unsolved):
        raise
    except Exception as e:
        raise Wrong(f"one_f_one_b({stage}, {stages}, {m}) raised {type(e).__name__}: {e}") from None
    return _actions(got, f"one_f_one_b({stage}, {stages}, {m})")


def _check_one_stage(actions, stage, p, m) -> None:
    """What is wrong with this stage's order, in the attendee's terms; nothing if it is 1F1B's."""
    call = f"one_f_one_b({stage}, {p}, {m})"
    other = [a for a in actions if a.op not in ("F", "B")]
    if other:
        raise Wrong(f"{call} returned {other[0].op}: list only the computations, F and B; the sends and receives "
                    "are put around them for you")
    for op in ("F", "B"):
        got = sorted(a.microbatch for a in actions if a.op == op)
        if got != list(range(m)):
            missing = sorted(set(range(m)) - set(got))
            twice = sorted({j for j in got if got.count(j) > 1})
            beyond = [j for j in got if not 0 <= j < m]
            if beyond:
                raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs {op}{beyond[0]}, but the micro-batches are "
                            f"0..{m - 1}: when m is smaller than p - stage - 1 the warm-up is all m of them, "
                            "min(p - stage - 1, m)")
            why = f"micro-batch {missing[0]} has none" if missing else f"micro-batch {twice[0]} has {got.count(twice[0])}"
            raise Wrong(f"with p = {p}, m = {m}, stage {stage} must run one {op} per micro-batch 0..{m - 1}: {why}")
    seen = set()
    for a in actions:
        if a.op == "B" and a.microbatch not in seen:
            raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs B{a.microbatch} before F{a.microbatch}: a "
                        "backward needs the activations its forward saved")
        seen.add(a.microbatch)
    want = reference_order(stage, p, m)
    if actions == want:
        return
    first = next(i for i, a in enumerate(actions) if a.op == "B")   # forwards before the first backward
    warmup, expected = min(p - stage - 1, m), min(p - stage, m)
    if first != expected:
        if first == m:
            raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs all {m} forwards before its first backward: "
                        f"that is GPipe, with {m} micro-batches in flight. 1F1B's warm-up on stage {stage} is "
                        f"p - stage - 1 = {warmup} forwards")
        if first == expected + 1:
            raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs {first} forwards before its first backward, "
                        f"one too many: the warm-up is p - stage - 1 = {warmup} forwards, and the steady state's "
                        f"first forward makes {expected} (the last stage has no warm-up: it starts each backward "
                        "right after the forward that computed the loss)")
        if first == expected - 1:
            raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs its first backward after {first} forwards, one "
                        f"too few: after the {warmup} warm-up forwards the steady state runs a forward first, then "
                        "the backward (micro-batch 0's gradient comes back only after its forward has been through "
                        "every later stage)")
        raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs {first} forwards before its first backward; 1F1B "
                    f"runs min(p - stage - 1, m) = {warmup} warm-up forwards, then one more before backward 0")
    backs = [a.microbatch for a in actions if a.op == "B"]
    if backs != sorted(backs):
        raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs its backwards in the order {backs}: oldest first, "
                    "in the order of the forwards, as the gradients come back down the pipeline")
    raise Wrong(f"with p = {p}, m = {m}, stage {stage} runs {_order(actions)}; after its {warmup} warm-up forwards "
                f"1F1B alternates one forward and one backward: {_order(want)}")


def check_one_f_one_b_locally(fn) -> str:
    """The simulator's half of the grade: structure, the order, no deadlock, bubble and memory."""
    from ..estimate.simulator import ScheduleError, bubble_over_ideal, check_happens_before, simulate
    for p, m in ONE_F_ONE_B_CASES:
        for stage in range(p):
            _check_one_stage(_compute_order(fn, stage, p, m), stage, p, m)
        lists = attendee_schedule(fn, p, m)
        try:
            check_happens_before(lists, p, 1)
        except ScheduleError as e:
            raise Wrong(f"with p = {p}, m = {m} the stages cannot run your orders together: {e}") from None
        timeline = simulate(lists)
        if abs(timeline.bubble_over_ideal - bubble_over_ideal(p, m)) > 1e-9:
            raise Wrong(f"with p = {p}, m = {m} the simulator measures idle / busy = {timeline.bubble_over_ideal:.3g}, "
                        f"not (p - 1) / m = {bubble_over_ideal(p, m):.3g}")
        want_peak = [min(p - s, m) for s in range(p)]
        if timeline.peak_inflight_microbatches != want_peak:
            raise Wrong(f"with p = {p}, m = {m} the stages keep {timeline.peak_inflight_microbatches} micro-batches in "
                        f"flight at most, expected min(p - stage, m) = {want_peak}")
    return "ok"


def check_one_f_one_b(one_f_one_b, rt) -> dict:
    """Rank side: the pipeline executor runs the attendee's action lists on real ranks (2 stages, 4
    micro-batches) in place of the library's 1F1B; every gradient must be the dense model's."""
    import torch

    from ..model import ModelConfig, TinyGPT, lm_loss
    from ..parallel import ParallelConfig, make_strategy
    p, m = rt.world_size, 4
    try:
        lists = attendee_schedule(one_f_one_b, p, m)
    except Unsolved:
        return {"status": "unsolved"}
    cfg = ModelConfig("lab05", n_layers=2, hidden=32, heads=4, vocab=57, seq_len=8)

    def build():
        torch.manual_seed(0)
        return TinyGPT(cfg)

    dense = build()
    data = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 57, (2 * m, 8), generator=data), torch.randint(0, 57, (2 * m, 8), generator=data)
    batches = [(xb.to(rt.device), yb.to(rt.device)) for xb, yb in zip(x.chunk(m), y.chunk(m))]
    dense.to(rt.device)
    for xb, yb in batches:
        (lm_loss(dense(xb), yb) / m).backward()
    strategy = make_strategy(rt, ParallelConfig.build(p, "pp", pp=p, schedule="1f1b", microbatches=m))
    model = strategy.parallelize(build())
    strategy.runner.actions = lambda m: lists[strategy.mesh.pp_rank]  # the attendee's list runs, not the library's
    out = on_ranks.on_rank(strategy.forward_backward, model, batches)
    if out["status"] != "ok":
        return out
    strategy.finish_backward(model)
    reference = dict(dense.named_parameters())
    for part in model:
        for name, param in part.named_parameters():
            want = reference[name.replace("lm_head", "tok_emb")].grad
            if param.grad is None or not torch.allclose(param.grad, want, rtol=1e-4, atol=1e-6):
                return {"status": "wrong", "message": f"on stage {strategy.mesh.pp_rank} the gradient of {name} "
                                                      "differs from the dense model's"}
    ran = [(op, j) for _, _, op, j, _ in strategy.events]
    return {"status": "ok", "value": ran}


def grade_one_f_one_b(fn, source) -> str:
    if re.search(r"\bschedule\s*\(", source or ""):
        raise Wrong("your one_f_one_b calls schedule(...), the library's own 1F1B: write the order from the three "
                    "phases yourself (the exercise is the order, not a call)")
    check_one_f_one_b_locally(fn)
    return on_ranks.grade(source, __name__, "check_one_f_one_b(one_f_one_b, rt)", RANKS,
                          f"on p = 4, 2, 4, 3 stages with m = 8, 4, 2, 5 micro-batches every stage runs 1F1B's order, "
                          "nothing deadlocks, the simulator finds the bubble (p - 1) / m with p - stage micro-batches "
                          f"in flight; and on {RANKS} real ranks the executor ran your lists with the dense model's "
                          "gradients", HANG, timeout=60)


register(Exercise(
    name="one_f_one_b", notebook="05", ranks=RANKS, title="One stage's 1F1B order",
    grade=grade_one_f_one_b,
    hints=("Three phases. Warm-up: Action(\"F\", j) for the first min(p - stage - 1, m) micro-batches. Steady state: "
           "for each remaining micro-batch, its forward and then the backward of the oldest micro-batch still "
           "waiting. Cool-down: the backwards that are left, in order.",
           "With w = min(stages - stage - 1, microbatches): [F 0 .. F w-1], then for j in range(m - w): "
           "F(j + w), B(j); then B(m - w) .. B(m - 1)."),
    solution='''
from labsupport.estimate.schedules import Action


def one_f_one_b(stage, stages, microbatches):
    warmup = min(stages - stage - 1, microbatches)           # fill the pipeline below this stage
    order = [Action("F", j) for j in range(warmup)]
    for j in range(microbatches - warmup):                   # steady state: one forward, one backward
        order += [Action("F", j + warmup), Action("B", j)]
    order += [Action("B", j) for j in range(microbatches - warmup, microbatches)]   # cool-down
    return order
'''))


# ---------------------------------------------------------------- find the bug: both neighbours send first

def grade_blocking_actions(fn, source) -> str:
    from ..estimate.simulator import ScheduleError, check_happens_before
    p = 2
    for m in BLOCKING_CASES:
        lists = []
        for stage in range(p):
            try:
                got = attempt(fn, stage, p, m)
            except (Wrong, Unsolved):
                raise
            except Exception as e:
                raise Wrong(f"blocking_actions({stage}, {p}, {m}) raised {type(e).__name__}: {e}") from None
            actions = _actions(got, f"blocking_actions({stage}, {p}, {m})")
            compute = [a for a in actions if a.op in ("F", "B")]
            if compute != reference_order(stage, p, m):
                raise Wrong(f"with m = {m}, stage {stage} computes {_order(compute)}, no longer 1F1B's order "
                            f"{_order(reference_order(stage, p, m))}: move only the sends and receives")
            lists.append(actions)
        try:
            check_happens_before(lists, p, 1)
        except ScheduleError as e:
            raise Wrong(f"with m = {m} the messages no longer match, even with sends that do not block: {e}") from None
        try:
            check_happens_before(lists, p, 1, blocking_sends=True)
        except ScheduleError as e:
            raise Wrong(f"with p = 2, m = {m} and blocking sends the simulator finds a {e}") from None
    return ("with 2 stages and m = 2, 4 and 8, every blocking SEND finds its RECV: where a send meets a receive, "
            "one stage receives before it sends, so the two stages never both wait in a send")


BLOCKING_LESSON = paragraphs(
    "Why it hung. In 1F1B's steady state on two stages each stage ends a computation with a send and only then "
    "receives. After its forward of micro-batch 1, stage 0 sends the activation (SEND_F1) and would then receive "
    "the gradient of micro-batch 0 (RECV_B0); at the same moment stage 1, done with the backward of micro-batch 0, "
    "sends that gradient (SEND_B0) and would then receive the next activation (RECV_F1). The two sends cross. A "
    "blocking send returns only once the other side has posted its receive, so each stage waits in its send for a "
    "receive the other never reaches: the simulator's deadlock, and on real ranks the hang above, both ranks in "
    "comm.send. The library's lists assume sends that do not block (isend): gloo then posts both messages and both "
    "receives complete.",
    "Two cures are in use. Order: on two stages, let one of them receive first, as this lab's fix does. "
    "DeepSpeed's "
    "pipeline engine, whose sends block too (dist.send in deepspeed/runtime/pipe/p2p.py), orders every exchange "
    "so: its TrainSchedule runs the stages in lock-step, neighbours always in opposite phases (one in a forward "
    "step, the other in a backward step), and in a forward step a stage sends its gradient back before it "
    "receives the next activation, while its neighbour, in a backward step, receives that gradient before it "
    "sends the activation: each send meets its receive.",
    "Post both at once: labsupport's executor posts each send together with the receive that follows it as one "
    "batch_isend_irecv group (PipelineSchedule._post in labsupport/parallel/pipeline_schedule.py), as Megatron-LM's "
    "send_forward_recv_backward does by default (batch_p2p_comm); then neither side waits for the other to start. "
    "Where Megatron-LM overlaps these messages with compute (overlap_p2p_comm, for its interleaved schedule), "
    "it posts them one by one instead and orders them by rank, as above: an even pipeline rank posts its send "
    "first, an odd one its receive (_p2p_ops in megatron/core/pipeline_parallel/p2p_communication.py). NCCL needs this even with "
    "non-blocking sends: its guide asks that point-to-point calls which must progress together go in one group, "
    "or they may deadlock.")

register(Exercise(
    name="blocking_actions", notebook="05", bug_lab=True,
    title="Find the bug: 1F1B with blocking sends",
    grade=grade_blocking_actions, lesson=BLOCKING_LESSON,
    cause=("sends cross", "the two sends", "send first", "sends first", "receive first", "receives first",
           "both send", "swap"),
    hints=("Read the simulator's message: where does each stage wait, and for what? A blocking send returns only "
           "once the other stage has reached the matching receive.",
           "In the steady state both stages finish a computation and send (stage 0 an activation forward, stage 1 a "
           "gradient back), then receive. Let one of them receive first: on stage 1, swap every SEND that is "
           "directly followed by a RECV."),
    solution='''
from labsupport.estimate.schedules import schedule


def blocking_actions(stage, stages, microbatches):
    actions = list(schedule("1f1b", stages, microbatches)[stage])
    if stage % 2 == 1:   # the odd stage receives first where a send meets a receive
        i = 0
        while i < len(actions) - 1:
            if actions[i].op.startswith("SEND") and actions[i + 1].op.startswith("RECV"):
                actions[i], actions[i + 1] = actions[i + 1], actions[i]
                i += 2
            else:
                i += 1
    return actions
'''))


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "naive_idle": ("Each stage works 1 + 2 = 3 of the 12 time units (its forward and its backward) and waits for the "
                   "other three stages the rest: (p - 1) / p = 3/4. Four devices do the work of one."),
    "interleaved": ("Each of the v passes through the ring of stages is 1/v of a stage's layers, so the ramp up and "
                    "down is p - 1 forwards and backwards of one chunk, each 1/v of a stage's: idle / busy = "
                    "(p - 1) / (v m) = 3 / 16, half of 1F1B's 3 / 8. The price: v times the point-to-point messages "
                    "(every chunk boundary is a send), and more activations in flight during warm-up: every stage "
                    "holds more than twice as many chunk forwards as 1F1B holds micro-batches, each half a stage's "
                    "(the line below)."),
    "live_bubble": ("The formula counts only the ramp, on a machine where messages are free and ranks stay in "
                    "step: (p - 1) / (m + p - 1) = 1/9. The run has neither. The gaps that the simulated chart does "
                    "not have are messages: stage 1, between a backward and the next forward, waits for the "
                    "activation that stage 0 sends only after its own forward, and each message costs time (here a "
                    "copy through the loopback, on the same two cores that compute). And two ranks that share two "
                    "cores with this notebook are rarely in step. Both add waiting. On GPUs with "
                    "NVLink or InfiniBand the messages are small beside a real stage's compute and the formula is "
                    "a good guide; where it is not, the measured chart shows where the time went."),
    "memory_ratio": ("Stage 0 holds m = 8 micro-batches' activations at its peak under GPipe and p - 0 = 2 under "
                     "1F1B: 4x. The last stage shows 1F1B at its best, 8 against 1: it runs each backward right "
                     "after its forward. The meter counts the tensors autograd keeps for backward, the same bytes "
                     "for every micro-batch, so the ratios are exactly the counts of micro-batches in flight."),
}


# ---------------------------------------------------------------- the check cell's expectations

def check(naive, measured, stages: int, microbatches: int) -> None:
    """Section 13's claims about sections 2 and 9, kept here so that the check cell's source does not
    spell out the answers of their predictions. Raises AssertionError with what differs."""
    from ..estimate.simulator import bubble_fraction
    units, idle = naive.total_time, naive.idle
    assert units == 12 and all(i == 9 for i in idle), \
        f"section 2: the naive pipeline took {units} time units with idle {idle}, not 12 with 9 on every stage"
    forwards = [sorted((s[0], s[1]) for s in rank if s[2] == "F") for rank in measured.spans]
    assert forwards[1][0][0] >= forwards[0][0][1], \
        (f"section 9: stage 1's first forward starts at {forwards[1][0][0]:.4f} s, before stage 0's ends at "
         f"{forwards[0][0][1]:.4f} s: the two stages' times are not on one clock")
    first = [min(s[0] for s in r) for r in measured.spans]
    last = [max(s[1] for s in r) for r in measured.spans]
    assert first[1] > first[0] and last[0] > last[1], \
        f"section 9: stage 1 should start late and stage 0 finish late: starts {first}, ends {last}"
    got, formula = measured.bubble_fraction, bubble_fraction(stages, microbatches)
    assert side_of(got, formula) == "above", \
        f"section 9: the measured bubble {got:.1%} is not above the formula's {formula:.1%}"
