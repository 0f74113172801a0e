"""The hands-on part of the workbook: graded exercises, find-the-bug labs, predict-then-run.

    %load_ext labsupport                 # enables %%exercise NAME
    from labsupport import lab
    lab.hint("ring_reduce_scatter_step"); lab.solution("ring_reduce_scatter_step"); lab.progress()
    lab.lesson("mean_loss")              # what a lab teaches, once it is solved
    lab.reveal(guess_ring_bytes, measured, unit="bytes", why="ring_bytes")   # the text: nb00_collectives.WHY

Each notebook's exercises live in one module here (nb00_collectives, ...); the mechanism is
exercise.py, the runner on real ranks on_ranks.py, predictions predict.py (each module's WHY
holds its notebook's explanations).
"""
from .exercise import ExerciseFailed, hint, lesson, progress, solution
from .predict import reveal

__all__ = ["ExerciseFailed", "hint", "lesson", "progress", "reveal", "solution"]
