"""The exercises grade as intended: every reference solution passes, typical wrong answers get
the feedback written for them, unsolved templates say so in one line, bug labs print their
symptom until fixed. Distributed checks run on real ranks (a pool per world size, as a notebook
with `%ranks start` would; the launch path is tested once)."""
import re

import pytest

from labsupport.estimate.workshop import HANDS_ON
from labsupport.lab import exercise as ex
from labsupport.lab import predict
from labsupport.lab.nb06_3d_parallelism import LAYOUT_CASES


def grade(name, source, capsys):
    """(status, printed line or the ExerciseFailed message: a bug lab changed and still buggy raises too).
    The printed lines are unwrapped (ex.unwrap): the phrases checked may straddle a line break."""
    try:
        status = ex.run_cell(name, source, {})
    except ex.ExerciseFailed as e:
        return ex.BUGGY if ex.get(name).bug_lab else ex.WRONG, str(e)
    return status, ex.unwrap(capsys.readouterr().out)


def solution(name):
    return ex.get(name).solution


def mutate(name, old, new):
    src = solution(name)
    assert old in src, (name, old)
    return src.replace(old, new)


@pytest.fixture(scope="module")
def pool4():
    from labsupport.pool import ranks
    ranks.start(4, timeout=60)
    yield ranks
    ranks.stop()


@pytest.fixture
def pool2(pool4):
    """The module's pool on 2 ranks, started again where a test before stopped it (a check without a
    pool of its size takes a fresh launch, ~3 s, instead of well under a second)."""
    if not (pool4.running and pool4.nproc == 2):
        pool4.stop()
        pool4.start(2, timeout=60)
    return pool4


# ---------------------------------------------------------------- local exercises (no ranks)

LOCAL_WRONG = [
    ("wire_bytes", '"all_reduce": 2 * (n - 1)', '"all_reduce": (n - 1)', r"wire_bytes\('all_reduce', 1,000,000, 2\) returned 500000.0; .* 1,000,000 bytes"),
    ("wire_bytes", '"all_gather": n - 1,', '"all_gather": n,', r"wire_bytes\('all_gather'.* 500,000 bytes"),
    ("tinygpt_params", "12 * d * d", "11 * d * d", r"12 d², not 11 d²"),
    ("tinygpt_params", "vocab * d + seq_len * d", "vocab * d", r"position embeddings are parameters too"),
    ("tinygpt_params", "return vocab * d", "return 2 * vocab * d", r"tied to the token embedding: one matrix, counted once"),
    ("bytes_per_param", "dict(params=2, grads=4, optimizer=12)", "dict(params=2, grads=2, optimizer=12)",
     r"^bytes_per_param: for 'megatron-bf16' your 'grads' has too few bytes$"),
    ("bytes_per_param", "dict(params=2, grads=2, optimizer=16)", "dict(params=4, grads=2, optimizer=12)",
     r"^bytes_per_param: for 'megatron-fp16' your 'params' has too many bytes and 'optimizer' has too few bytes$"),
    ("bytes_per_param", "dict(params=2, grads=2, optimizer=16)", "dict(params=2, optimizer=16)",
     r"^bytes_per_param: for 'megatron-fp16' your dict misses 'grads'$"),
    ("bytes_per_param", "dict(params=2, grads=2, optimizer=16)", "dict(params=2, grads=2, optimizer=None)",
     r"^bytes_per_param: for 'megatron-fp16' your 'optimizer' is None, not a number of bytes$"),
    ("training_days", "6 * n_params", "2 * n_params", r"days, 6·N·D / \(GCDs · peak · MFU\) gives"),
    ("training_days", "/ 86400", "/ 3600", r"days, 6·N·D"),
]


@pytest.mark.parametrize("name", ["wire_bytes", "tinygpt_params", "bytes_per_param", "training_days", "accumulate"])
def test_local_reference_solutions_pass(name, capsys):
    status, out = grade(name, solution(name), capsys)
    assert status == ex.SOLVED and out.startswith(f"✔ {name}:"), out


@pytest.mark.parametrize("name, old, new, feedback", LOCAL_WRONG)
def test_local_wrong_answers_get_their_feedback(name, old, new, feedback, capsys):
    status, message = grade(name, mutate(name, old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


def test_an_unsolved_template_says_so_in_one_line(capsys):
    status, out = grade("wire_bytes", "def wire_bytes(op, payload_bytes, n):\n    raise NotImplementedError\n", capsys)
    assert status == ex.UNSOLVED and out.count("\n") == 1 and "not solved yet" in out and "lab.hint('wire_bytes')" in out


def test_the_accumulation_bug_lab_prints_its_symptom_until_fixed(capsys):
    buggy = mutate("accumulate", "(loss / len(micro_batches)).backward()", "loss.backward()")
    status, out = grade("accumulate", buggy, capsys)
    assert status == ex.BUGGY and "4.00x the whole batch's" in out and "Adam ignores a common scale" in out


def test_a_changed_bug_lab_that_still_fails_says_it_was_checked(capsys):
    buggy = mutate("accumulate", "(loss / len(micro_batches)).backward()", "loss.backward()")
    status, out = grade("accumulate", buggy, capsys)
    assert status == ex.BUGGY and out.startswith("🐞 accumulate, the bug to find: "), out  # words, for a box glyph
    with pytest.raises(ex.ExerciseFailed):  # one red line, as for a wrong answer
        ex.run_cell("accumulate", buggy.replace("loss.backward()", "(2.0 * loss).backward()"), {})
    status, message = grade("accumulate", buggy.replace("loss.backward()", "(1.0 * loss).backward()"), capsys)
    assert status == ex.BUGGY and "your change was checked, and the bug is still there" in message, message
    assert "4.00x the whole batch's" in message and ex.get("accumulate").status == ex.BUGGY


FP16_CLIP = "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # ... then the clip measures them\n"
FP16_UNSCALE = "    scaler.unscale_(optimizer)                     # the true gradients first ...\n"
FP16_RENORM = "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))   # the clipped ones' norm\n"


def test_the_fp16_bug_labs_symptom_is_what_a_log_shows_and_a_scaled_clip_is_told_what_it_does(capsys):
    """Issue 28: as shipped (clip, then unscale) the 🐞 line says what the attendee would see, the norm the step
    returns and how far the weights moved against torch's recipe, and names neither the loss scale nor the
    cause. A clip of the still-scaled gradients at max_norm x S has the recipe's effect up to rounding: its
    feedback says so, and that the norm it returns is still S times the true one."""
    lab = ex.get("fp16_step")
    lab.shipped = None                                   # the first source graded below is the cell as shipped
    shipped = mutate("fp16_step", FP16_UNSCALE + FP16_CLIP, FP16_CLIP + FP16_UNSCALE)
    status, out = grade("fp16_step", shipped, capsys)
    assert status == ex.BUGGY and out.startswith("🐞 fp16_step, the bug to find: the step returns a gradient norm of "
                                                 "1.145e+05 where torch's recipe, from the same start, returns 1.747, "
                                                 "and after 3 steps the weights have moved 0.62x as far from their "
                                                 "start as the recipe's"), out
    assert "scale" not in out.lower() and "65,536" not in out and not [c for c in lab.cause if c.lower() in out.lower()]
    scaled_clip = shipped.replace("clip_grad_norm_(model.parameters(), max_norm)",
                                  "clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())")
    status, message = grade("fp16_step", scaled_clip, capsys)
    assert status == ex.BUGGY and "your change was checked" in message, message
    clip_guard = (r"your step clips the still-scaled gradients at max_norm x S\. That is the recipe's clip but for "
                  r"clip_grad_norm_'s 1e-6 guard .* after 3 steps [\d,]+ of 108,288 weights differ")
    assert re.search(clip_guard + r".* The norm it returns, 1\.145e\+05, is 65,536 times the recipe's 1\.747", message)
    rescaled = scaled_clip.replace("    return norm", "    return norm / scaler.get_scale()")
    status, message = grade("fp16_step", rescaled, capsys)
    assert status == ex.BUGGY and re.search(clip_guard, message) and "The norm it returns" not in message, message
    # issue 28: clip, then unscale, and the norm divided by S: the first norm is right, the weights and the next
    # norms are not; the symptom, not a checklist (third reading: "the gradient norms are right" was not checked)
    status, message = grade("fp16_step", shipped.replace("    return norm", "    return norm / scaler.get_scale()"), capsys)
    assert status == ex.BUGGY and re.search(r"at step 2 the step returns a gradient norm of [\d.]+ where torch's recipe, "
                                            r"from the same start, returns [\d.]+, and after 3 steps the weights have "
                                            r"moved 0\.62x as far from their start as the recipe's", message) \
        and "does every step" not in message, message
    # the recipe's order, but the norm returned after the clip: the updates are right, the logged norm is not
    after_clip = mutate("fp16_step", FP16_UNSCALE + FP16_CLIP, FP16_UNSCALE + FP16_CLIP + FP16_RENORM)
    status, message = grade("fp16_step", after_clip, capsys)
    assert status == ex.BUGGY and message.endswith("your step's updates are the recipe's, but the step returns a gradient "
                                                   "norm of 1 where torch's recipe, from the same start, returns 1.747 "
                                                   "(the unscaled gradients' norm, before the clip)"), message


def test_a_cell_that_defines_nothing_is_named(capsys):
    status, message = grade("wire_bytes", "x = 1\n", capsys)
    assert status == ex.WRONG and "must define `wire_bytes`" in message


def test_solutions_mode_runs_the_reference_and_refuses_failure(monkeypatch, capsys):
    monkeypatch.setenv("LABSUPPORT_SOLUTIONS", "1")
    status, out = grade("training_days", "def training_days(*a):\n    raise NotImplementedError\n", capsys)
    assert status == ex.SOLVED and "running the reference solution" in out
    bug = ex.get("accumulate")
    monkeypatch.setattr(bug, "solution", mutate("accumulate", "(loss / len(micro_batches))", "loss"))
    with pytest.raises(ex.ExerciseFailed, match="reference solution does not pass"):
        ex.run_cell("accumulate", "", {})


def test_hints_come_one_at_a_time_and_solution_prints_a_cell(capsys):
    exercise = ex.get("wire_bytes")
    exercise.hints_shown = 0
    ex.hint("wire_bytes")
    assert capsys.readouterr().out.count("hint ") == 1
    ex.hint("wire_bytes")
    assert capsys.readouterr().out.count("hint ") == 2
    assert ex.solution("wire_bytes", load=False) is None  # a cell's last line shows it once, printed
    assert capsys.readouterr().out.startswith("%%exercise wire_bytes\ndef wire_bytes(")


def test_progress_lists_every_exercise_with_its_status(capsys):
    ex.progress("00")
    out = capsys.readouterr().out
    for name in ("ring_reduce_scatter_step", "ring_all_gather_step", "wire_bytes", "mean_loss"):
        assert re.search(rf"^00  {name} +(✔ )?\S", out, re.M), out
    assert re.search(r"^\d of 4 done$", out, re.M) and "tinygpt_params" not in out


def test_unknown_exercise_is_named():
    with pytest.raises(KeyError, match="no exercise named 'nope'"):
        ex.get("nope")


@pytest.mark.parametrize("guess, measured, verdict", [
    (None, 3.0, "No prediction entered. Measured: 3."), (3.1, 3.0, "You predicted 3.1; measured 3: right."),
    (6.0, 3.0, "You predicted 6; measured 3: off by a factor 2."), (0, 3, "You predicted 0; measured 3: off by 3."),
    ("b", "b", "the answer is 'b': right."),
    ("a", "b", "the answer is 'b': not quite."), (1_500_000, 1_572_864, "measured 1,572,864: right.")])
def test_reveal_compares_a_prediction(guess, measured, verdict, capsys):
    predict.reveal(guess, measured, why="all_to_all")
    out = ex.unwrap(capsys.readouterr().out)
    assert verdict in out and out.rstrip().endswith(" the all-to-all transposes it."), out


@pytest.mark.parametrize("guess, verdict", [
    ("below", "You predicted 'below'; the answer is 'below': right."),
    ("above", "You predicted 'above'; the answer is 'below': not quite."),
    ("lower", "You predicted 'lower', which is none of the answers offered ('above', 'below'); the answer is 'below'.")])
def test_a_guess_outside_the_offered_choices_is_told_so(guess, verdict, capsys):
    predict.reveal(guess, "below", label="The table", choices=("above", "below"))
    assert verdict in ex.unwrap(capsys.readouterr().out)


@pytest.mark.parametrize("guess, verdict", [(None, "No prediction entered. Formula: 0.1111."),
                                            (0.11, "You predicted 0.11; formula 0.1111: right.")])
def test_reveal_names_where_its_value_comes_from(guess, verdict, capsys):
    predict.reveal(guess, 0.1111, label="Formula")
    out = capsys.readouterr().out
    assert verdict in out and "easured" not in out, out


def test_an_explanation_is_looked_up_by_the_predictions_name():
    """The cell names the explanation; the text lives in the notebook's lab module (nb05_pipeline_parallel.WHY)."""
    from labsupport.lab.nb05_pipeline_parallel import WHY
    assert predict.explain("naive_idle") == WHY["naive_idle"]
    assert predict.explanations()["naive_idle"] == WHY["naive_idle"]


def test_an_explanation_with_fields_takes_its_values_from_the_cell(capsys):
    values = dict(padded_params=817_920, n_tensors=52, optimizer_bytes=6_543_568)
    assert predict.fields(predict.explanations()["optimizer_mb"]) == set(values)
    predict.reveal(None, 6.543568, unit="MB", why="optimizer_mb", **values)
    assert ex.unwrap(capsys.readouterr().out) == (
        "No prediction entered. Measured: 6.544 MB. 8 bytes (Adam's two fp32 moments) x 817,920 parameters, the "
        "vocabulary padding rows included, + a 4-byte `step` per tensor (52 tensors): 6,543,568 bytes.\n")


def test_an_unknown_explanation_is_named_with_the_known_ones():
    with pytest.raises(KeyError, match=r"no explanation named 'nope'; the explanations are: .*naive_idle"):
        predict.reveal(None, 1.0, why="nope")
    with pytest.raises(KeyError, match="no explanation named"):  # text where the key belongs: not a key either
        predict.explain("Each stage works 1 + 2 = 3 of the 12 time units")


@pytest.mark.parametrize("values", [{}, {"n_layers": 4}, {"n_layers": 4, "blocks_share": 0.97, "extra": 1}])
def test_an_explanation_says_which_values_it_takes(values):
    with pytest.raises(TypeError, match=r"'params' takes the values \['blocks_share', 'n_layers'\]"):
        predict.explain("params", **values)
    with pytest.raises(TypeError, match="takes the values none"):
        predict.explain("naive_idle", n_layers=4)


def test_explanations_render_and_their_keys_are_unique(monkeypatch):
    for key, text in predict.explanations().items():
        assert key.isidentifier() and text.strip() == text and text.endswith((".", ")")), key
        assert predict.explain(key, **{f: 1 for f in predict.fields(text)})
    from labsupport.lab import nb00_collectives
    monkeypatch.setitem(nb00_collectives.WHY, "naive_idle", "again")
    with pytest.raises(ValueError, match="'naive_idle' is defined twice"):
        predict.explanations()


# ---------------------------------------------------------------- feedback that fits the browser's output area

FEEDBACK = ("after step 0 of the ring reduce-scatter rank 0 holds chunk 2 = [55.0, 55.0], expected 45.0: each "
            "micro-batch's gradient is summed with its neighbour's, not with the one it should be summed with, "
            "so https://example.org/a-very-long-address-that-fits-on-no-line-of-eighty-eight-characters-at-all/ "
            "stays whole.\n    an indented line of its own, also longer than the width of the output area, "
            "so that it wraps too")


def words(text: str) -> list[str]:
    return re.sub(r"\033\[\d+m", "", text).split()


def test_wrap_breaks_long_lines_between_words_only():
    """JupyterLab breaks a text output's line wider than its output area at any character ("micro-bat" /
    "ch"): feedback comes in lines of at most WIDTH characters, broken between words."""
    wrapped = ex.wrap(FEEDBACK)
    lines = wrapped.split("\n")
    assert words(wrapped) == words(FEEDBACK)  # no word split, none lost, hyphens kept ("micro-batch")
    assert all(len(line) <= ex.WIDTH or " " not in line.strip() for line in lines), lines
    assert lines[0].startswith("after step 0") and all(line.startswith("  ") for line in lines[1:3])
    url = next(w for w in words(FEEDBACK) if w.startswith("https:"))
    assert len(url) > ex.WIDTH and f"  {url}" in lines  # longer than WIDTH: whole, on a line of its own
    indented = lines.index(next(line for line in lines if line.startswith("    an indented")))
    assert lines[indented + 1].startswith("      ")  # its own indentation kept, plus INDENT
    first = FEEDBACK.splitlines()[0]
    assert ex.unwrap(ex.wrap(first)) == first and ex.wrap("short line\n\nnext") == "short line\n\nnext"


def test_a_wrong_answer_renders_in_red_lines_that_fit_and_keeps_its_message_whole():
    err = ex.ExerciseFailed(f"ring_reduce_scatter_step: {FEEDBACK.splitlines()[0]}")
    rendered = err._render_traceback_()
    assert len(rendered) > 1 and all(r.startswith("\033[31m") and r.endswith("\033[0m") for r in rendered)
    assert words(" ".join(rendered)) == ["✘", *words(str(err))] and "\n" not in str(err)
    assert all(len(re.sub(r"\033\[\d+m", "", r)) <= ex.WIDTH or " " not in r.strip() for r in rendered[:2])


def test_printed_feedback_hints_and_reveals_fit_the_output_area(capsys):
    buggy = mutate("accumulate", "(loss / len(micro_batches)).backward()", "loss.backward()")
    ex.run_cell("accumulate", buggy, {})
    ex.get("accumulate").hints_shown = 0
    for _ in ex.get("accumulate").hints:
        ex.hint("accumulate")
    predict.reveal(None, 9, why="naive_idle")
    out = capsys.readouterr().out
    assert len(out.splitlines()) > 4 and max(map(len, out.splitlines())) <= ex.WIDTH, out
    assert ex.unwrap(out).splitlines()[0].startswith("🐞 accumulate, the bug to find: ")
    assert ex.unwrap(out).splitlines()[-1].endswith(predict.explain("naive_idle"))


# ---------------------------------------------------------------- on real ranks

RING_WRONG = [
    ("ring_reduce_scatter_step", "send_chunk = (rank - step - 1) % world", "send_chunk = (rank - step) % world",
     r"after step 0 of the ring reduce-scatter rank \d holds chunk \d = \[.*\], expected"),
    ("ring_reduce_scatter_step", "chunks[recv_chunk] += incoming", "chunks[recv_chunk].copy_(incoming)",
     r"after step \d of the ring reduce-scatter rank \d holds chunk"),
    ("ring_reduce_scatter_step", "comm.irecv(incoming, left)]", "comm.irecv(incoming, left)]\n    comm.all_reduce(incoming)",
     r"a ring step is exactly one comm.isend to the right and one comm.irecv from the left"),
    ("ring_all_gather_step", "comm.irecv(chunks[(rank - step - 1) % world], left)",
     "comm.irecv(chunks[(rank - step) % world], left)", r"after step 0 of the ring all-gather rank \d holds chunk"),
    ("ring_all_gather_step", "(rank - step) % world], right)", "(rank + step) % world], right)",
     r"ring all-gather rank \d holds chunk"),
]


@pytest.mark.multiprocess
def test_ring_references_pass_and_wrong_steps_are_located(pool4, capsys):
    for name in ("ring_reduce_scatter_step", "ring_all_gather_step"):
        status, out = grade(name, solution(name), capsys)
        assert status == ex.SOLVED and "all 3 steps on 4 ranks" in out, out
    for name, old, new, feedback in RING_WRONG:
        status, message = grade(name, mutate(name, old, new), capsys)
        assert status == ex.WRONG and re.search(feedback, message), (name, new, message)
    template = "def ring_all_gather_step(chunks, step, rank, world):\n    raise NotImplementedError\n"
    assert grade("ring_all_gather_step", template, capsys)[0] == ex.UNSOLVED


HOOK_WRONG = [
    ('comm.all_reduce(bucket.buffer, "avg", async_op=True)', 'comm.all_reduce(bucket.buffer, "sum", async_op=True)',
     r"2x, the sum over the ranks; average them"),
    ("copy_(p.grad.view(-1))", "copy_(p.detach().view(-1))", r"it equals the weights\. The hook receives the parameter"),
    ("    if len(bucket.ready) == len(bucket.params):", "    if False:", r"bucket 0 \(of \d+\) was never launched"),
]


@pytest.mark.multiprocess
def test_data_parallel_exercises_and_bug_labs_on_two_ranks(pool2, capsys):
    status, out = grade("on_grad_ready", solution("on_grad_ready"), capsys)
    assert status == ex.SOLVED, out
    for old, new, feedback in HOOK_WRONG:
        status, message = grade("on_grad_ready", mutate("on_grad_ready", old, new), capsys)
        assert status == ex.WRONG and re.search(feedback, message), (new, message)
    # picotron's bug: the hook all-reduces the parameter; the gradients stay local
    buggy = mutate("register_hooks", "comm.all_reduce(param.grad", "comm.all_reduce(param")
    status, out = grade("register_hooks", buggy, capsys)
    assert status == ex.BUGGY and "🐞 register_hooks" in out and "single-device one in norm" in out, out
    assert grade("register_hooks", solution("register_hooks"), capsys)[0] == ex.SOLVED
    # summed gradients: twice the single device's
    status, out = grade("sync_gradients", mutate("sync_gradients", '"avg"', '"sum"'), capsys)
    assert status == ex.BUGGY and "is 2x the single-device one in norm" in out, out
    assert "the sum over the ranks" not in out, out  # the symptom, not the cause: the lesson names it
    assert grade("sync_gradients", solution("sync_gradients"), capsys)[0] == ex.SOLVED
    # a collective on one rank only: the hang is caught, named, and the pool comes back
    buggy = mutate("mean_loss", '    comm.all_reduce(total, "avg")          # every rank takes part\n'
                   '    if comm.get_rank() == 0 and step % 2 == 0:\n',
                   '    if comm.get_rank() == 0 and step % 2 == 0:\n        comm.all_reduce(total, "avg")\n')
    status, out = grade("mean_loss", buggy, capsys)
    assert status == ex.BUGGY and "did not finish" in out and "rank 0" in out and 'lab.hint("mean_loss")' in out, out
    assert not any(phrase in out.lower() for phrase in ex.get("mean_loss").cause), out   # where, not why
    status, out = grade("mean_loss", solution("mean_loss"), capsys)
    assert status == ex.SOLVED, out


# ---------------------------------------------------------------- notebook 03: ZeRO (on two ranks)

ZERO1_WRONG = [
    ("shard = -(-numel // world)", "shard = numel // world",
     r"elements 8\.\.9 of 10 belong to no rank\. Pad the buffer"),
    ("return rank * shard, (rank + 1) * shard", "return (world - 1 - rank) * shard, (world - rank) * shard",
     r"that is rank 3's piece\. Rank r owns the r-th contiguous piece"),
    ("shard_range(numel, comm.get_rank(), comm.get_world_size())",
     "shard_range(numel, 1 - comm.get_rank(), comm.get_world_size())",
     r"step 0: on rank 0 adamw updated elements \[32, 64\) \(rank 1's\) of the padded buffer of 64, "
     r"but rank 0 owns \[0, 32\)"),
    ("    comm.all_gather_into_tensor(flat, shard)", "",
     r"step 0: on rank \d the other ranks' parameters are still those before the step.*All-gather the updated shards"),
    ("comm.all_gather_into_tensor(flat, shard)", "comm.all_gather_into_tensor(grad, grad[start:end].clone())",
     r"all-gather was called, but .* gather the updated parameter shard into flat, not the gradients"),
    ("shard.grad = grad[start:end]", "shard.grad = grad[:end - start]",
     r"on rank 1 shard.grad is not this rank's slice of the averaged gradients: use grad\[32:64\]"),
]


@pytest.mark.multiprocess
def test_zero_exercise_and_bug_labs_on_two_ranks(pool2, capsys):
    status, out = grade("zero1_step", solution("zero1_step"), capsys)
    assert status == ex.SOLVED and "3 steps on 2 ranks" in out, out
    # the solution gathers in place (its input is a slice of its output); a copy as the input is right too
    assert "all_gather_into_tensor(flat, shard)" in solution("zero1_step")
    copied = mutate("zero1_step", "all_gather_into_tensor(flat, shard)", "all_gather_into_tensor(flat, shard.clone())")
    assert grade("zero1_step", copied, capsys)[0] == ex.SOLVED
    for old, new, feedback in ZERO1_WRONG:
        status, message = grade("zero1_step", mutate("zero1_step", old, new), capsys)
        assert status == ex.WRONG and re.search(feedback, message), (new, message)
    # clipping by the local shard's norm: the ranks scale their shards differently
    buggy = mutate("clip_sharded_", '    comm.all_reduce(total, "sum")', "    pass")
    status, out = grade("clip_sharded_", buggy, capsys)
    assert status == ex.BUGGY and re.search(r"the ranks changed their shards' norms by [\d.]+x on rank 0 and [\d.]+x on rank 1;",
                                            out), out
    assert grade("clip_sharded_", solution("clip_sharded_"), capsys)[0] == ex.SOLVED
    # ZeRO-3 that frees only in training: evaluation keeps every block gathered
    buggy = mutate("shard_block", "            output.register_hook(lambda grad: unit.gather())\n        unit.free()",
                   "            output.register_hook(lambda grad: unit.gather())\n            unit.free()")
    status, out = grade("shard_block", buggy, capsys)
    assert status == ex.BUGGY and "in evaluation, 2 of 2 blocks are still gathered" in out, out
    assert "no_grad" not in out  # the symptom, not the cause: the second hint names it
    assert grade("shard_block", solution("shard_block"), capsys)[0] == ex.SOLVED
    template = "def shard_range(numel, rank, world):\n    raise NotImplementedError\n\n\n" \
               "def zero1_step(flat, grad, numel, adamw):\n    raise NotImplementedError\n"
    assert grade("zero1_step", template, capsys)[0] == ex.UNSOLVED

# ---------------------------------------------------------------- notebook 04: tensor parallelism

TP_LOCAL_WRONG = [
    ("column_parallel_forward", "weight.chunk(world, dim=0)", "weight.chunk(world, dim=1)",
     r"raised RuntimeError: .* A torch Linear's weight is \(out, in\): .* cut weight along dim 0"),
    ("column_parallel_forward", "w_parts[i], b_parts[i])", "w_parts[i], None)", r"rank 0's output lacks the bias"),
    ("column_parallel_forward", "w_parts[i], b_parts[i])", "weight, bias)",
     r"rank 0's output has shape \(4, 8\), expected \(4, 4\): that is the whole output"),
    ("column_parallel_forward", "w_parts[i], b_parts[i])", "w_parts[i], b_parts[0])",
     r"rank 1 added the first slice of the bias"),
    ("row_parallel_forward", "x_parts[i], w_parts[i])", "x, weight)",
     r"rank 0's partial output differs from x_i @ weight_i\.T \(its inputs 0\.\.2\)"),
    ("row_parallel_forward", "partials, sum(partials)", "partials, sum(partials) / world",
     r"y differs from x @ weight\.T by up to [\d.]+: it is the sum of all the partials"),
    ("row_parallel_forward", "weight.chunk(world, dim=1)", "weight.chunk(world, dim=0)",
     r"raised RuntimeError: .* same slice of its dim 1"),
    # the transpose forgotten: the slices are right, the product is not (issue 28: it pointed at the slicing)
    ("row_parallel_forward", "torch.nn.functional.linear(x_parts[i], w_parts[i])", "x_parts[i] @ w_parts[i]",
     r"^(?!.*same slice)(?=.*cannot be multiplied \(4x3 and 8x3\)).*Your slices have the right shapes, x_i \(4, 3\) and "
     r"weight_i \(8, 3\), and rank i's partial output should be \(4, 8\), tokens by out features"),
    ("row_parallel_forward", "torch.nn.functional.linear(x_parts[i], w_parts[i])", "w_parts[i] @ x_parts[i].T",
     r"^(?!.*Cut weight).*rank 0's partial output has shape \(8, 4\), expected \(4, 8\): it holds the right numbers, "
     r"transposed"),
]


@pytest.mark.parametrize("name", ["column_parallel_forward", "row_parallel_forward"])
def test_tensor_parallel_one_process_references_pass(name, capsys):
    status, out = grade(name, solution(name), capsys)
    assert status == ex.SOLVED and "T = 2, 4 and 3 ranks" in out, out


@pytest.mark.parametrize("name, old, new, feedback", TP_LOCAL_WRONG)
def test_tensor_parallel_one_process_wrong_answers_get_their_feedback(name, old, new, feedback, capsys):
    status, message = grade(name, mutate(name, old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


def test_tensor_parallel_feedback_sentences():
    """Issue 28: the ranks' ratios read as a sentence (not "1.13, 2.1 (rank 0, 1, ...) times"), and a changed
    row_parallel_linear says what it moved against the cell as shipped (removing the bias flips the sign of
    the shipped difference at T = 2, the same numbers otherwise)."""
    import torch

    from labsupport.lab.nb04_tensor_parallel import _output_line, _times
    assert _times([1.126, 2.1]) == "1.13x the dense one on rank 0 and 2.10x on rank 1"
    assert _times([2.0, 2.0]) == "2.00x the dense one on both ranks"
    assert _times([1, 2, 3]) == "1.00x the dense one on rank 0, 2.00x on rank 1 and 3.00x on rank 2"
    want, b = torch.randn(5, 6), torch.randn(6) + 2
    shipped = want + b
    where = "on rank 0 of 2"
    as_shipped = _output_line(shipped, want, shipped, where, changed=False)
    assert re.fullmatch(r"on rank 0 of 2 the output differs from the dense layer's by [\d.]+ on average, up to "
                        r"[\d.]+", as_shipped) and "bias" not in as_shipped
    assert _output_line(shipped, want, shipped, where, changed=True).startswith(
        "on rank 0 of 2 the output is still the one the cell as shipped gives: it differs")
    removed = _output_line(want - b, want, shipped, where, changed=True)
    assert removed.startswith("the output moved: on rank 0 of 2 its difference from the dense layer's is now the "
                              "negative of the shipped cell's, the same size") and "bias" not in removed, removed
    assert "is now 3.00 times the shipped cell's" in _output_line(want + 3 * b, want, shipped, where, changed=True)
    assert re.search(r"now differs from the dense layer's by [\d.]+ on average, up to [\d.]+ \(as shipped: ",
                     _output_line(want + b + torch.randn(5, 6), want, shipped, where, changed=True))


TP_MLP_WRONG = [
    ("linear(h, w2)           # my partial sum of the full output\n    comm.all_reduce(y, \"sum\")                       "
     "# g: every rank now holds the sum\n    return y + b2",
     'linear(h, w2, b2)\n    comm.all_reduce(y, "sum")\n    return y',
     r"holds the second bias 2 times: every rank added it before the all-reduce"),
    ('    comm.all_reduce(y, "sum")', '    comm.all_reduce(y, "avg")', r"the average of the partial sums, not their sum"),
    ('    comm.all_reduce(y, "sum")', "    pass", r"this rank's partial sum only: all-reduce"),
    ("    return y + b2", "    comm.all_reduce(h, 'max')\n    return y + b2",
     r"the output is right, but rank \d made these collectives: all_reduce x2\. Megatron's MLP needs one"),
]

CONJUGATE_WRONG = [
    ('if op == "f":', 'if op in ("f", "g"):',
     r"the forward is right, but x's gradient is 2\.00x the dense one on both ranks \(in norm\), and the weights' "
     r"gradients are 2x the dense ones: g's backward summed"),
    ('        comm.all_reduce(grad, "sum")    # x', "        pass  # x",
     r"x's gradient is [\d.]+x the dense one on (rank 0 and [\d.]+x on rank 1|both ranks) \(in norm\): each rank "
     r"holds only .* your backward made no all-reduce"),
    ('        comm.all_reduce(grad, "sum")    # x', '        comm.all_reduce(grad, "avg")    # x',
     r"x's gradient is 0\.50x the dense one on both ranks \(in norm\)\. The weights' gradients are right, so the "
     r"trouble is in f's backward: it must return the sum over the ranks"),
    ('    if op == "f":', '    if op == "g":\n        comm.all_reduce(grad, "avg")\n    if op == "f":',
     r"the gradients are right, but backward made 2 all-reduces .* one is enough"),
]


@pytest.mark.multiprocess
def test_tensor_parallel_exercises_and_bug_lab_on_two_ranks(pool2, capsys):
    status, out = grade("tp_mlp_forward", solution("tp_mlp_forward"), capsys)
    assert status == ex.SOLVED and "exactly one all-reduce" in out, out
    for old, new, feedback in TP_MLP_WRONG:
        status, message = grade("tp_mlp_forward", mutate("tp_mlp_forward", old, new), capsys)
        assert status == ex.WRONG and re.search(feedback, message), (new, message)
    status, out = grade("conjugate_backward", solution("conjugate_backward"), capsys)
    assert status == ex.SOLVED and "one all-reduce in backward" in out, out
    for old, new, feedback in CONJUGATE_WRONG:
        status, message = grade("conjugate_backward", mutate("conjugate_backward", old, new), capsys)
        assert status == ex.WRONG and re.search(feedback, message), (new, message)
        # issue 28: the feedback says what the answer did wrong, never what the backward of f or g is
        assert not re.search(r"identity|leave it as it is|must sum", message), (new, message)
    swapped = mutate("conjugate_backward", 'if op == "f":', 'if op == "g":')  # f's backward and g's exchanged
    status, message = grade("conjugate_backward", swapped, capsys)
    assert status == ex.WRONG and re.search(r"the forward is right, but x's gradient is [\d.]+x the dense one on rank 0 "
                                            r"and [\d.]+x on rank 1 \(in norm\), and the weights' gradients are 2x "
                                            r"the dense ones: g's backward summed", message), message
    # the row-parallel bias added before the all-reduce: the symptom is the difference, not its cause
    ex.get("row_parallel_linear").shipped = None     # `buggy` below is the cell as shipped
    buggy = mutate("row_parallel_linear", "linear(x_shard, w_shard)", "linear(x_shard, w_shard, bias)").replace(
        "    return y + bias", "    return y")
    status, out = grade("row_parallel_linear", buggy, capsys)
    assert status == ex.BUGGY and "🐞 row_parallel_linear" in out, out
    assert re.search(r"on rank \d of 2 the output differs from the dense layer's by [\d.]+ on average", out), out
    assert "bias" not in out.split("row_parallel_linear", 1)[1], out
    # issue 28: a partial fix says what it moved; an edit that changes nothing says so
    status, message = grade("row_parallel_linear", buggy.replace("w_shard, bias)   #", "w_shard)   #"), capsys)
    assert status == ex.BUGGY and "the output moved: on rank 0 of 2 its difference from the dense layer's is now " \
                                  "the negative of the shipped cell's" in message, message
    status, message = grade("row_parallel_linear", buggy + "# looked at it\n", capsys)
    assert status == ex.BUGGY and "the output is still the one the cell as shipped gives" in message, message
    # issue 28: fixes that get the output right but not what the bias learns do not pass
    for wrong_bias, feedback in (("bias / comm.get_world_size()", r"on rank 0 of 2 the gradient of the bias is 0\.50x "
                                                                  r"the dense layer's in norm"),
                                 ("bias if comm.get_rank() == 0 else None", r"on rank 1 of 2 the bias gets no gradient")):
        status, message = grade("row_parallel_linear", buggy.replace("w_shard, bias)   #", f"w_shard, {wrong_bias})   #"), capsys)
        assert status == ex.BUGGY and re.search(r"the output equals the dense layer's, but " + feedback, message), message
    status, out = grade("row_parallel_linear", solution("row_parallel_linear"), capsys)
    assert status == ex.SOLVED and "the gradients of x_shard, w_shard and the bias equal the dense layer's" in out, out
    template = "def conjugate_backward(op, grad):\n    raise NotImplementedError\n"
    assert grade("conjugate_backward", template, capsys)[0] == ex.UNSOLVED


# ---------------------------------------------------------------- notebook 05: pipeline parallelism

ONE_F_ONE_B_WRONG = [
    ("min(stages - stage - 1, microbatches)", "microbatches",
     r"stage 0 runs all 8 forwards before its first backward: that is GPipe, with 8 micro-batches in flight"),
    ("min(stages - stage - 1, microbatches)", "min(stages - stage, microbatches)",
     r"stage 0 runs 5 forwards before its first backward, one too many: the warm-up is p - stage - 1 = 3"),
    ("min(stages - stage - 1, microbatches)", "stages - stage - 1",
     r"p = 4, m = 2, stage 0 runs F2, but the micro-batches are 0\.\.1: .* min\(p - stage - 1, m\)"),
    ('[Action("F", j + warmup), Action("B", j)]', '[Action("B", j), Action("F", j + warmup)]',
     r"stage 0 runs its first backward after 3 forwards, one too few"),
    ("for j in range(microbatches - warmup, microbatches)]",
     "for j in reversed(range(microbatches - warmup, microbatches))]",
     r"backwards in the order \[0, 1, 2, 3, 4, 7, 6, 5\]: oldest first"),
    ("    return order", "    return order + [Action('SEND_F', 0)]",
     r"returned SEND_F: list only the computations, F and B"),
    ("    return order", "    return order[:-1]", r"must run one B per micro-batch 0\.\.7: micro-batch 7 has none"),
]


@pytest.mark.parametrize("old, new, feedback", ONE_F_ONE_B_WRONG)
def test_one_f_one_b_wrong_orders_get_their_feedback_before_any_rank_runs(old, new, feedback, capsys):
    status, message = grade("one_f_one_b", mutate("one_f_one_b", old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


def test_wire_bytes_is_not_solved_by_reading_the_librarys_factors(capsys):
    lookup = ("from labsupport.estimate.comm_cost import BUS_FACTOR\n\n\n"
              "def wire_bytes(op, payload_bytes, n):\n    return BUS_FACTOR[op](n) * payload_bytes\n")
    status, message = grade("wire_bytes", lookup, capsys)
    assert status == ex.WRONG and "BUS_FACTOR" in ex.unwrap(message), message


def test_one_f_one_b_is_not_solved_by_calling_the_librarys_schedule(capsys):
    call = ("from labsupport.estimate.schedules import schedule\n\n\n"
            "def one_f_one_b(stage, stages, microbatches):\n"
            "    return [a for a in schedule('1f1b', stages, microbatches)[stage] if a.op in ('F', 'B')]\n")
    status, message = grade("one_f_one_b", call, capsys)
    assert status == ex.WRONG and "calls schedule(...)" in ex.unwrap(message), message


def test_one_f_one_b_template_says_not_yet(capsys):
    template = "def one_f_one_b(stage, stages, microbatches):\n    raise NotImplementedError\n"
    assert grade("one_f_one_b", template, capsys)[0] == ex.UNSOLVED


def test_the_blocking_sends_bug_lab_names_the_stuck_stages_until_fixed(capsys):
    buggy = ("from labsupport.estimate.schedules import schedule\n\n\n"
             "def blocking_actions(stage, stages, microbatches):\n"
             "    return schedule(\"1f1b\", stages, microbatches)[stage]\n")
    status, out = grade("blocking_actions", buggy, capsys)
    assert status == ex.BUGGY and "🐞 blocking_actions" in out, out
    assert "deadlock: stage 0 at SEND_F(micro-batch 1, chunk 0) (to stage 1); stage 1 at SEND_B(micro-batch 0" in out, out
    both = mutate("blocking_actions", "if stage % 2 == 1:", "if True:")    # both receive first: still stuck
    status, out = grade("blocking_actions", both, capsys)
    assert status == ex.BUGGY and "stage 0 at RECV_B(micro-batch 0" in out, out
    gpipe = buggy.replace('"1f1b"', '"gpipe"')                            # runs, but it is no longer 1F1B
    status, out = grade("blocking_actions", gpipe, capsys)
    assert status == ex.BUGGY and "no longer 1F1B's order" in out, out
    dropped = mutate("blocking_actions", "    return actions", "    return [a for a in actions if a.op != 'SEND_B']")
    status, out = grade("blocking_actions", dropped, capsys)
    assert status == ex.BUGGY and "the messages no longer match" in out, out
    status, out = grade("blocking_actions", solution("blocking_actions"), capsys)
    assert status == ex.SOLVED and "every blocking SEND finds its RECV" in out, out


def locked(name, monkeypatch):
    """Exercise `name` as an attendee meets it: not solved, its lesson not earned, not the stored copy."""
    monkeypatch.delenv(ex.STORED, raising=False)
    monkeypatch.delenv("LABSUPPORT_SOLUTIONS", raising=False)
    exercise = ex.get(name)
    monkeypatch.setattr(exercise, "earned", False)
    monkeypatch.setattr(exercise, "status", ex.BUGGY if exercise.bug_lab else ex.UNSOLVED)
    return exercise


def test_the_blocking_sends_lesson_opens_once_the_check_passes(monkeypatch, capsys):
    """Issue 28: why the sends deadlock and how DeepSpeed and Megatron avoid it stood in the notebook right under
    the lab; it is the lab's lesson now, printed under the check's ✔ line and by lab.lesson() from then on."""
    locked("blocking_actions", monkeypatch)
    ex.lesson("blocking_actions")
    assert capsys.readouterr().out.startswith("🔒 (locked) What blocking_actions teaches appears here once")
    status, out = grade("blocking_actions", solution("blocking_actions"), capsys)
    assert status == ex.SOLVED and "\nWhy it hung." in out and "The two sends cross." in out, out
    ex.lesson("blocking_actions")
    out = capsys.readouterr().out
    assert out.startswith("Why it hung.") and "TrainSchedule" in out and "batch_isend_irecv" in out
    assert max(len(line) for line in out.splitlines()) <= 100   # JupyterLab would break a longer line mid-word
    # issue 28: the lesson is also shown after lab.solution("blocking_actions"): it cannot speak of "your fix"
    assert "your fix" not in ex.get("blocking_actions").lesson


def test_the_mean_loss_lesson_comes_with_its_solution_and_not_before(monkeypatch, capsys):
    locked("mean_loss", monkeypatch)
    ex.lesson("mean_loss")
    assert "(locked)" in capsys.readouterr().out
    ex.solution("mean_loss", load=False)
    out = capsys.readouterr().out
    assert out.startswith("%%exercise mean_loss\n") and "Why it hung. The all-reduce sat inside" in out, out
    ex.lesson("mean_loss")
    assert capsys.readouterr().out.startswith("Why it hung.")


def test_the_stored_copy_shows_every_lesson_of_00_and_05(monkeypatch, capsys):
    for name in ("mean_loss", "blocking_actions"):
        locked(name, monkeypatch)
        monkeypatch.setenv(ex.STORED, "1")
        ex.lesson(name)
        assert ex.unwrap(capsys.readouterr().out) == ex.get(name).lesson + "\n"


@pytest.mark.multiprocess
def test_one_f_one_b_runs_for_real_on_two_ranks(pool2, capsys):
    status, out = grade("one_f_one_b", solution("one_f_one_b"), capsys)
    assert status == ex.SOLVED and "on 2 real ranks the executor ran your lists with the dense model's gradients" in out, out


@pytest.mark.multiprocess
def test_without_a_pool_a_check_runs_through_a_launch(capsys):
    from labsupport.pool import ranks
    ranks.stop()  # the module's pools may still run
    status, out = grade("sync_gradients", mutate("sync_gradients", '"avg"', '"sum"'), capsys)
    assert status == ex.BUGGY and "is 2x the single-device one in norm" in out, out
    assert "(checking on 2 fresh ranks, a few seconds: no pool is running" in out, out


def test_a_fresh_launch_gives_the_checks_limit_to_the_ranks_work(monkeypatch):
    """A hang check's limit is for the ranks' work: a fresh launch counts it from the moment its ranks are up
    (launch's timeout does, tests/test_launch.py), so their start needs no allowance on top of it here."""
    from labsupport.lab import on_ranks
    from labsupport.pool import ranks
    ranks.stop()
    asked = {}

    def launch(script, nproc, timeout, **kwargs):
        asked.update(kwargs, timeout=timeout)
        raise on_ranks.LaunchError("stopped here")
    monkeypatch.setattr(on_ranks, "launch", launch)
    with pytest.raises(on_ranks.RanksFailed):
        on_ranks.run("x = 1", "labsupport.lab.nb00_collectives", "check_mean_loss(x)", 2, timeout=10)
    assert asked["timeout"] == 10 and "startup_timeout" not in asked   # launch's own start-up allowance


# ---------------------------------------------------------------- notebook 06 (graded by the planner, no ranks)

LAYOUT_WRONG = [
    ("    cfg = get_preset(model)\n    best = None", "    return dict(dp=1, tp=1, pp=1, micro_batch=1, zero=0)",
     r"dp x tp x pp = 1 x 1 x 1 = 1, not the 48 GPUs"),
    ("for tp in (1, 2, 4, 8):", "for tp in (1,):",
     r"175b on 256 Frontier GCDs \(global batch 640\): TP 1 x PP 16 x DP 16, .* fits but takes 94\.7 s a step, 1\.35x "
     r"the planner's best \(TP 4 x PP 32 x DP 2.*\)\. Yours against the best: bubble \+18\.7 s, .*TP -5\.91 s\."),
    ("for tp in (1, 2, 4, 8):", "for tp in (16,):", r"22b on 48 .*TP 16 x PP 3 x DP 1.* Yours against the best: TP \+167 s"),
    ('["total"] <= USABLE', '["total"] <= 1e15',
     r"22b on 48 Frontier GCDs .*TP 1 x PP 3 x DP 16, .*no recomputation needs 103\.8 GB per GCD \(model states "
     r"34\.9 GB, activations 68\.9 GB\), more than the 57\.6 GB usable of 64 GB\. More model parallelism \(tp x pp\) "
     r"or heavier activation recomputation would shrink it$"),
    ("    return best[1]", "    return tuple(best[1].values())", r"should return a dict with keys dp, tp, pp, micro_batch, zero"),
    ("micro_batch=1, zero=zero, recompute=recompute))", "zero=zero, recompute=recompute))", r"micro_batch missing"),
]


def test_choose_layout_reference_passes_within_the_planners_margin(capsys):
    status, out = grade("choose_layout", solution("choose_layout"), capsys)
    assert status == ex.SOLVED and "within 1.2x of the planner's best" in out, out


@pytest.mark.parametrize("old, new, feedback", LAYOUT_WRONG)
def test_choose_layout_wrong_answers_say_what_does_not_fit_or_where_time_goes(old, new, feedback, capsys):
    status, message = grade("choose_layout", mutate("choose_layout", old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


def test_choose_layout_refuses_an_answer_from_the_planner(capsys):
    """One call to the library's solver is not an answer; the planner works again after the check."""
    from labsupport.estimate import planner
    asked = ("from labsupport.model import get_preset\n"
             "def choose_layout(model, gpus, global_batch):\n"
             "    c = {call}(get_preset(model), MACHINE_NAMES['frontier'], gpus, global_batch)[0]\n"
             "    return dict(dp=c.dp, tp=c.tp, pp=c.pp, micro_batch=c.micro_batch, zero=c.zero)\n")
    for call, namespace in (("plan", {"plan": planner.plan, "MACHINE_NAMES": planner.MACHINE_NAMES}),
                            ("P.plan", {"P": planner, "MACHINE_NAMES": planner.MACHINE_NAMES})):
        try:
            ex.run_cell("choose_layout", asked.format(call=call), namespace)
        except ex.ExerciseFailed as e:
            assert "called the planner's `plan`" in str(e), e
        else:
            raise AssertionError(f"an answer calling {call} passed")
    assert namespace["P"].plan is planner.plan and planner.plan.__name__ == "plan"


def test_choose_layout_is_not_answered_by_the_layouts_printed_above_it(capsys):
    """The cases are the hands-on models on node counts the notebook prints no layout for: the
    scripts' layouts copied do not split the GPUs, and their TP x PP with the DP that fills the
    GPUs does not split 22B's batch and runs 175B at 1.24x the best."""
    layouts = {m: {k: v for k, v in s.layout().items() if k != "recompute"} for m, s in HANDS_ON.items()}
    assert all((m, s.gpus, s.global_batch) not in LAYOUT_CASES for m, s in HANDS_ON.items())
    copied = f"def choose_layout(model, gpus, global_batch):\n    return {layouts!r}[model]\n"
    status, message = grade("choose_layout", copied, capsys)
    assert status == ex.WRONG and "dp x tp x pp = 2 x 1 x 8 = 16, not the 48 GPUs" in message, message
    refilled = (f"def choose_layout(model, gpus, global_batch):\n    layout = dict({layouts!r}[model])\n"
                "    layout['dp'] = gpus // (layout['tp'] * layout['pp'])\n    return layout\n")
    status, message = grade("choose_layout", refilled, capsys)
    assert status == ex.WRONG and "global batch 640 is not a multiple of dp x micro-batch = 6 x 1" in message, message
    scripts_tp_pp = ("def choose_layout(model, gpus, global_batch):\n"
                     "    tp, pp = {'22b': (1, 12), '175b': (4, 16), '1t': (4, 128)}[model]\n"
                     "    return dict(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=1, zero=1)\n")
    status, message = grade("choose_layout", scripts_tp_pp, capsys)
    assert status == ex.WRONG and "175b on 256 Frontier GCDs" in message and "TP 4 x PP 16 x DP 4" in message, message
    assert "1.24x the planner's best" in message and "compute +12.8 s (full recomputation against selective" in message, message


def test_choose_layout_does_not_advise_what_an_answer_already_uses(capsys):
    """A layout with ZeRO-1 and full recomputation that does not fit is told only what is left."""
    answer = ("def choose_layout(model, gpus, global_batch):\n"
              "    if model == '22b':\n"
              "        return dict(dp=4, tp=1, pp=12, micro_batch=1, zero=1)\n"
              "    return dict(dp=32, tp=1, pp=8, micro_batch=1, zero=1, recompute='full')\n")
    status, message = grade("choose_layout", answer, capsys)
    assert status == ex.WRONG and "175b on 256 Frontier GCDs" in message and "doesn't" not in message, message
    assert "ZeRO-1 over" not in message, message
    assert "recomputation would" not in message and "More model parallelism (tp x pp) would shrink it" in message, message


def test_the_rank_order_bug_lab_names_a_tp_group_across_nodes_until_fixed(capsys):
    buggy = "def place_rank(d, p, t, dp, pp, tp):\n    return (t * pp + p) * dp + d\n"
    status, out = grade("place_rank", buggy, capsys)
    assert status == ex.BUGGY and "TP group of (d, p) = (0, 0) is ranks 0, 4, on nodes 0, 1" in out, out
    pp_fastest = "def place_rank(d, p, t, dp, pp, tp):\n    return (d * tp + t) * pp + p\n"
    status, out = grade("place_rank", pp_fastest, capsys)
    assert status == ex.BUGGY and "dp 2 x pp 4 x tp 4 on nodes of 8 GPUs, the TP group of (d, p) = (0, 0) is ranks 0, 4, 8, 12" in out, out
    clash = "def place_rank(d, p, t, dp, pp, tp):\n    return p * tp + t\n"      # forgets d: two coordinates, one rank
    status, out = grade("place_rank", clash, capsys)
    assert status == ex.BUGGY and "which (d, p, t) = (0, 0, 0) has already" in out, out
    megatron = "def place_rank(d, p, t, dp, pp, tp):\n    return (p * dp + d) * tp + t\n"   # tp, dp, pp: also right
    assert grade("place_rank", megatron, capsys)[0] == ex.SOLVED
    status, out = grade("place_rank", solution("place_rank"), capsys)
    assert status == ex.SOLVED and ex.get("place_rank").lesson in out, out   # the lesson, under the check's line


def test_the_rank_order_labs_shipped_cell_numbers_in_shipped_order():
    """The notebook's widget re-places the run's counters by SHIPPED_ORDER instead of spelling the order out under
    the lab: it must be the order the shipped place_rank numbers the grid in."""
    import json
    from pathlib import Path

    from labsupport.lab.nb06_3d_parallelism import SHIPPED_ORDER
    from labsupport.widgets.rank_grid import layout
    notebook = json.loads((Path(__file__).parents[1] / "notebooks" / "06_3d_parallelism.ipynb").read_text())
    cell = next("".join(c["source"]) for c in notebook["cells"] if "".join(c["source"]).startswith("%%exercise place_rank"))
    namespace = {}
    exec(cell.split("\n", 1)[1], namespace)
    for dp, pp, tp in ((2, 2, 2), (3, 2, 4)):
        coords = layout(dp, tp, pp, 4, SHIPPED_ORDER).coords
        assert [namespace["place_rank"](*c, dp, pp, tp) for c in coords] == list(range(dp * pp * tp))


def test_the_rank_grid_under_the_rank_order_lab_is_locked_until_the_lab_is_earned(monkeypatch, capsys):
    """Mesh's rank table, its figure, the traffic in both orders and the widget each show the order place_rank asks
    for: until the lab is solved (or its solution shown) the cell under it prints one locked line; the stored copy
    shows them all. The run's counters are checked either way."""
    from labsupport.lab.nb06_3d_parallelism import rank_grid
    ops = {"all_reduce": {"calls": 1, "payload_bytes": 8, "wire_bytes": 8}}
    traffic = {"parallel": {"dp": 2, "tp": 2, "pp": 2}, "comm_groups": [{"tp": ops, "pp": ops, "dp": ops}] * 8}
    lab = ex.get("place_rank")
    for env in ("LABSUPPORT_STORED_COPY", "LABSUPPORT_SOLUTIONS"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(lab, "status", ex.BUGGY)
    monkeypatch.setattr(lab, "earned", False)
    rank_grid(traffic)
    out = ex.unwrap(capsys.readouterr().out)
    assert out.startswith("🔒 (locked)") and out.count("\n") == 1 and "lab.solution('place_rank')" in out, out
    assert not any(word in out for word in ("fastest", "(d, p, t)", "tp, pp, dp", "dp, pp, tp")), out
    for unlock in (lambda: monkeypatch.setattr(lab, "earned", True),
                   lambda: (monkeypatch.setattr(lab, "earned", False), monkeypatch.setenv("LABSUPPORT_STORED_COPY", "1"))):
        unlock()
        rank_grid(traffic)
        out = capsys.readouterr().out
        assert "(0, 0, 1)   [0, 1]" in out and "order tp, pp, dp (fastest first)" in out and "locked" not in out, out
        assert "order dp, pp, tp (fastest first): bytes crossing nodes per step: tp 64, pp 0, dp 0" in out, out


# ---------------------------------------------------------------- notebook 07: context and experts

MERGE_WRONG = [
    ("lse = torch.logaddexp(lse1, lse2)", "lse = torch.log(torch.exp(lse1) + torch.exp(lse2))",
     r"with scores in the hundreds your lse or out holds inf or nan: exp .* overflows"),
    ("lse = torch.logaddexp(lse1, lse2)", "lse = torch.maximum(lse1, lse2)", r"that is the larger of the two"),
    ("lse = torch.logaddexp(lse1, lse2)", "lse = lse1 + lse2", r"that is lse1 \+ lse2"),
    ("out = out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None]",
     "out = out1 * torch.exp(lse1 - lse) + out2 * torch.exp(lse2 - lse)", r"needs \[\.\.\., None\]"),
    ("out = out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None]",
     "out = (out1 + out2) / 2", r"the lse is right but .* plain mean of the two outputs"),
]


def test_online_softmax_merge_reference_passes(capsys):
    status, out = grade("online_softmax_merge", solution("online_softmax_merge"), capsys)
    assert status == ex.SOLVED and "scores of about 1 and in the hundreds" in out, out


@pytest.mark.parametrize("old, new, feedback", MERGE_WRONG)
def test_online_softmax_merge_wrong_answers_get_their_feedback(old, new, feedback, capsys):
    status, message = grade("online_softmax_merge", mutate("online_softmax_merge", old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


RING_STEP_WRONG = [
    ("return out, merged, k_next, v_next", "return out, merged, k, v",
     r"after step 0 rank \d holds rank \d's K block; it should hold rank \d's, received from the previous rank"),
    ("+ block_out * torch.exp", "+ 0 * block_out * torch.exp", r"the lse is right: check how the outputs are weighted"),
    # newcomer pass: the block received attended instead of the one held, merged right; the merge was blamed
    ("    block_out, block_lse = attend(q, k, v)",
     "    for work in works:\n        work.wait()\n    block_out, block_lse = attend(q, k_next, v_next)",
     r"in step 0 rank \d's result is what attending rank \d's block, the one it received, gives: a step computes "
     r"with the block it holds at the start"),
    ("return out, merged, k_next, v_next", "return block_out, block_lse, k_next, v_next", r"by inf: .* do not replace them"),
]

DISPATCH_WRONG = [  # each message says what was checked, what was expected and what came back
    ("order = choice.argsort(stable=True)", "order = torch.arange(len(choice))",
     r"checked on rank \d: your send_counts \[\d+, \d+\] are right, but all_to_all_single sends the first "
     r"send_counts\[0\] rows to rank 0, .* should go to ranks \[0, .*, 1\] in that order; yours go to \[.*\]"),
    ("choice // (n_experts // ep)", "choice % ep",
     r"checked on rank \d with choice = \[.*\] \(4 experts, 2 a rank: expert e lives on rank e // 2\): "
     r"send_counts should be \[\d+, \d+\], yours is \[\d+, \d+\]"),
    # newcomer pass: e // ep passed with 4 experts on 2 ranks (2 a rank, = ep); with 8 it sends to ranks 0 ... 3
    ("choice // (n_experts // ep)", "choice // ep",
     r"checked on rank \d with choice = \[.*\] \(8 experts, 4 a rank: expert e lives on rank e // 4\): "
     r"send_counts should (hold 2 counts|be \[\d+, \d+\]), .*yours is \["),
    ("order = choice.argsort(stable=True)", "order = choice.argsort(stable=True)[:-1]",
     r"checked on rank \d, 12 tokens: order should hold each token index 0 \.\.\. 11 once, .*; yours is \["),
    # wrong on rank 1 only: rank 0 must not wait for it in an all-to-all; the verdict is rank 1's
    ("order = choice.argsort(stable=True)",
     "order = choice.argsort(stable=True) if comm.get_rank() == 0 else torch.arange(len(choice))",
     r"^checked on rank 1: your send_counts"),
]

# partial fixes of the bug lab: the symptom says how far the loss is now against the cell as shipped
RING_QUERIES_ONLY = ("owner * c + torch.arange(c)", "torch.arange(c)")  # the queries' positions fixed, the keys' not
RING_KEYS_ONLY = ("rank * c + torch.arange(c)", "torch.arange(c)")      # the keys' positions fixed, the queries' not


def test_wrap_keeps_a_tables_rows_whole():
    """The f/g table of 04's conjugate_backward lesson came out with its cells under the wrong columns
    (newcomer pass): a row whose columns are aligned by runs of spaces stays one line."""
    row = "f, where the parallel region starts   identity: every rank takes all of X   all-reduce of dX"
    assert ex.wrap(row) == row and len(row) > ex.WIDTH
    assert ex.wrap("word " * 30).count("\n") == 2  # prose still wraps


@pytest.mark.multiprocess
def test_a_ring_step_that_raises_after_posting_its_sends_leaves_the_next_attempt_clean(pool2, capsys):
    """Newcomer pass: a ring_step that raised between its isend/irecv and their waits left messages in flight
    on the pool, and the next, correct attempt timed out blaming its own sends. The ranks restart after a
    check whose code raised, and the next attempt passes."""
    raising = mutate("ring_step", "    block_out, block_lse = attend(q, k, v)",
                     "    block_out, block_lse = online_softmax_merge(q, k, v)")
    status, message = grade("ring_step", raising, capsys)
    assert status == ex.WRONG and "NameError" in message, message
    status, out = grade("ring_step", solution("ring_step"), capsys)
    assert status == ex.SOLVED, out


@pytest.mark.multiprocess
def test_context_and_experts_exercises_and_bug_lab_on_two_ranks(pool2, capsys):
    for name in ("ring_step", "dispatch"):
        status, out = grade(name, solution(name), capsys)
        assert status == ex.SOLVED, out
    assert "checked on 2 ranks, 12 tokens each, with 4 experts and with 8: with your order and send_counts" in out, out
    for name, cases in (("ring_step", RING_STEP_WRONG), ("dispatch", DISPATCH_WRONG)):
        for old, new, feedback in cases:
            status, message = grade(name, mutate(name, old, new), capsys)
            assert status == ex.WRONG and re.search(feedback, message.split(": ", 1)[1]), (new, message)
    template = "def dispatch(choice, n_experts, ep):\n    raise NotImplementedError\n"
    assert grade("dispatch", template, capsys)[0] == ex.UNSOLVED
    # the causal mask built from local positions: a plausible loss, gradients off; the symptom names no cause
    buggy = mutate("causal_ring_attention", "rank * c + torch.arange(c)", "torch.arange(c)").replace(
        "owner * c + torch.arange(c)", "torch.arange(c)")
    status, out = grade("causal_ring_attention", buggy, capsys)
    assert status == ex.BUGGY and "🐞 causal_ring_attention" in out, out
    assert re.search(r"the loss is [\d.]+ \(dense attention's: [\d.]+\), and the gradients are not the dense ones: "
                     r"d[qkv] on rank \d is \d+% off", out), out
    assert "position" not in out and "mask" not in out, out
    shipped, dense = map(float, re.search(r"the loss is ([\d.]+) \(dense attention's: ([\d.]+)\)", out).groups())
    # a partial fix: the loss against dense attention's, now and as shipped, and which way the change moved it
    for old, new in (RING_QUERIES_ONLY, RING_KEYS_ONLY):
        status, message = grade("causal_ring_attention", mutate("causal_ring_attention", old, new), capsys)
        m = re.search(r"your change was checked, and the bug is still there: the loss is ([\d.]+), ([\d.]+) from dense "
                      r"attention's ([\d.]+) \(as shipped: ([\d.]+), ([\d.]+) from it\): your change moved it "
                      r"(closer to|further from) dense attention's\. Still, the gradients are not the dense ones",
                      message)
        assert status == ex.BUGGY and m, message
        now, gap, dense_now, as_shipped, gap_shipped, moved = m.groups()
        assert (float(dense_now), float(as_shipped)) == (dense, shipped)
        assert moved == ("closer to" if float(gap) < float(gap_shipped) else "further from"), message
        assert "position" not in message and "mask" not in message, message
    status, out = grade("causal_ring_attention", solution("causal_ring_attention"), capsys)
    assert status == ex.SOLVED and ex.get("causal_ring_attention").lesson in out, out


def test_the_ring_bug_labs_loss_line_says_how_the_loss_moved():
    from labsupport.lab.nb07_context_and_experts import _loss_line
    assert _loss_line(2.3327, 2.2118, 2.3327) == ("the loss is 2.3327 (dense attention's: 2.2118)", ", and")
    assert _loss_line(2.2118, 2.2118, 2.3327) == ("the loss is now dense attention's, 2.2118 (as shipped: 2.3327)",
                                                  ", but")
    closer, join = _loss_line(2.25, 2.2118, 2.3327)
    assert closer.endswith("0.0382 from dense attention's 2.2118 (as shipped: 2.3327, 0.1209 from it): your change "
                           "moved it closer to dense attention's") and join == ". Still,"
    assert "further from" in _loss_line(2.5, 2.2118, 2.3327)[0]


def test_the_ring_bug_labs_cause_and_lesson():
    lab = ex.get("causal_ring_attention")
    assert {"local index", "local indices", "global position"} <= set(lab.cause)
    assert "compared local indices" in lab.lesson and "global positions" in lab.lesson
    assert "looked like a loss" in lab.lesson


# ---------------------------------------------------------------- the attendee's copy (make lab)

def test_make_lab_copies_the_notebooks_without_outputs_and_never_touches_a_copy(tmp_path):
    """A prediction's answer or a solved bug lab must not sit under the cell before it runs; a notebook
    the attendee has already worked in stays as it is; every kernel knows the magics."""
    import os
    import subprocess
    import sys

    import nbformat
    from conftest import REPO
    work = tmp_path / "work"
    mine = work / "notebooks" / "00_setup_and_collectives.ipynb"
    mine.parent.mkdir(parents=True)
    mine.write_text("my work")
    make = ["make", "--no-print-directory", "-C", str(REPO), "lab-copy", f"WORK={work}", f"VENV={sys.prefix}"]
    subprocess.run(make, check=True, capture_output=True)
    assert mine.read_text() == "my work"
    shipped = sorted((REPO / "notebooks").glob("*.ipynb"))
    assert sorted(p.name for p in mine.parent.glob("*.ipynb")) == [p.name for p in shipped]
    for path in shipped[1:]:
        copy, original = nbformat.read(work / "notebooks" / path.name, as_version=4), nbformat.read(path, as_version=4)
        assert [c.source for c in copy.cells] == [c.source for c in original.cells], path.name
        assert [c.get("outputs") for c in copy.cells if c.get("outputs")] == [], path.name
    config = (work / ".ipython" / "profile_default" / "ipython_kernel_config.py").read_text()
    assert "load_ipython_extension(get_ipython())" in config
    # laid out as the repo: notebook 03 reads ../configs/accelerate from its own folder
    assert [os.readlink(work / name) for name in ("README.md", "ARCHITECTURE.md", "configs")] == [
        "../README.md", "../ARCHITECTURE.md", "../configs"]
    (work / "notebooks" / shipped[1].name).unlink()  # deleted to start it over; an instructor keeps the outputs
    subprocess.run([*make, "OUTPUTS=keep"], check=True, capture_output=True)
    assert (work / "notebooks" / shipped[1].name).read_bytes() == shipped[1].read_bytes()
    assert mine.read_text() == "my work"


@pytest.mark.parametrize("notebook, name, marker", [
    ("04_tensor_parallel", "conjugate_backward", 'why="backward_op"'),   # which backward all-reduces, measured
    ("05_pipeline_parallel", "one_f_one_b", 'schedule("1f1b", 2, 4)'),  # 1F1B's lists for p = 2, m = 4
])
def test_a_cell_under_an_exercise_that_prints_its_answer_is_locked_until_the_exercise_is_earned(notebook, name, marker,
                                                                                        monkeypatch, capsys):
    """Issue 28 (newcomer pass): after Run All on the attendee's copy the cell under conjugate_backward printed what
    f's and g's backward do, and the one under one_f_one_b printed 1F1B's lists: each exercise's answer. Until it is
    earned the cell prints one locked line; once earned (or in the stored copy) it shows what it measures."""
    import json
    from pathlib import Path

    from labsupport.estimate.schedules import schedule
    cells = json.loads((Path(__file__).parents[1] / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    cell = next("".join(c["source"]) for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"]))
    locked(name, monkeypatch)
    exec(cell, {"schedule": schedule, "lab": None, "guess_backward_op": None})   # no pool: the locked branch runs none
    out = capsys.readouterr().out
    assert out.startswith("🔒 (locked) ") and f"once {name}'s check above passes" in " ".join(out.split()), out
    assert not re.search(r"identity|all-reduces in the backward|F0|B0", out), out
    if name == "one_f_one_b":
        monkeypatch.setattr(ex.get(name), "earned", True)
        exec(cell, {"schedule": schedule})
        assert capsys.readouterr().out.startswith("stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0")


# ---------------------------------------------------------------- notebook 01: a Llama's parameters (issue 30)

LLAMA_WRONG = [
    ("+ 2 * d * kv ", "+ 2 * d * d ", r"K and V are as wide as Q in your count.*2 x 32 = 64 here, not 128"),
    ("3 * d * ffn_hidden", "2 * d * ffn_hidden", r"SwiGLU has three matrices .* you count two"),
    ("3 * d * ffn_hidden", "8 * d * d", r"not GPT's two of width 4d"),
    ("head = 0 if tied else vocab * d", "head = 0", r"for llama-micro \(.*tied=False\).*The LM head is untied"),
    ("head = 0 if tied else vocab * d", "head = vocab * d", r"for llama-micro \(tied\).*counted once"),
    ("+ 2 * d          #", "+ 4 * d          #", r"RMSNorm has a gain and no shift"),
    ("n_layers * block + d", "n_layers * block", r"a final RMSNorm after the last block"),
]


def test_llama_params_reference_passes_and_names_mistral_7bs_count(capsys):
    status, out = grade("llama_params", solution("llama_params"), capsys)
    assert status == ex.SOLVED and "Mistral 7B (7,241,732,096)" in out and "10.5 d²" in out, out


@pytest.mark.parametrize("old, new, feedback", LLAMA_WRONG)
def test_llama_params_wrong_answers_say_which_part_is_off(old, new, feedback, capsys):
    status, message = grade("llama_params", mutate("llama_params", old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


def test_llama_params_is_not_solved_by_the_librarys_count(capsys):
    call = ("from labsupport.estimate.params import count_params\n\n\n"
            "def llama_params(n_layers, hidden, heads, kv_heads, ffn_hidden, vocab, tied):\n    return count_params(None)\n")
    status, message = grade("llama_params", call, capsys)
    assert status == ex.WRONG and "the library's count" in message, message


# Notebook 07, issue 30: the positions a rank rotates its queries and keys by under the balanced split.
ROPE_POSITIONS_WRONG = [
    ("    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))",
     "    return list(range(seq_len // cp))",
     r"s = 24, rank 1 of cp = 3: \[0, 1, .*, 7\] would be the same positions on every rank"),
    ("    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))",
     "    return list(range(rank * 2 * c, (rank + 1) * 2 * c))",
     r"\[8, 9, .*, 15\] is the plain split's piece .* 2 cp = 6 chunks of 4 and gives the rank two"),
    # a contiguous window of s / cp from the rank's first chunk: the first case's chunks lie apart, so it fails there on
    # its second chunk, not with the rows' message
    ("    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))",
     "    return list(range(front * c, front * c + seq_len // cp))",
     r"s = 24, rank 1 of cp = 3: the first chunk, \[4, 5, 6, 7\], is right; the second is \[8, 9, 10, 11\]"),
    # the library's own split, one call: refused
    ("    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))",
     "    from labsupport.parallel.context import positions\n    return positions(seq_len, rank, cp, True).tolist()",
     r"calls positions\(\.\.\.\) or shard_sequence\(\.\.\.\), the library's own split"),
    ("    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))",
     "    from labsupport.parallel import context\n"
     "    return context.shard_sequence(torch.arange(seq_len)[None], rank, cp, True)[0].tolist()",
     r"calls positions\(\.\.\.\) or shard_sequence\(\.\.\.\), the library's own split"),
    ("back = rank, 2 * cp - 1 - rank", "back = rank, cp + rank",
     r"the first chunk, \[4, 5, 6, 7\], is right; the second is \[12, 13, 14, 15\]"),
    ("    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))",
     "    return list(range(front * c, (front + 1) * c))", r"the rank holds s / cp = 8 tokens, so 8 positions"),
]


def test_rope_positions_reference_passes(capsys):
    status, out = grade("rope_positions", solution("rope_positions"), capsys)
    assert status == ex.SOLVED and "s = 24, cp = 3, rank 1" in out and "s = 32, cp = 4, rank 2" in out, out


@pytest.mark.parametrize("old, new, feedback", ROPE_POSITIONS_WRONG)
def test_rope_positions_wrong_answers_get_their_feedback(old, new, feedback, capsys):
    status, message = grade("rope_positions", mutate("rope_positions", old, new), capsys)
    assert status == ex.WRONG and re.search(feedback, message), message


def test_rope_positions_takes_an_attendees_own_helper_named_positions(capsys):
    """Only the library's split is refused: a helper of the attendee's own with that natural name is their work."""
    own = ("def positions(c, chunk):\n    return list(range(chunk * c, (chunk + 1) * c))\n\n\n"
           "def rope_positions(seq_len, rank, cp):\n    c = seq_len // (2 * cp)\n"
           "    return positions(c, rank) + positions(c, 2 * cp - 1 - rank)\n")
    status, out = grade("rope_positions", own, capsys)
    assert status == ex.SOLVED, out
