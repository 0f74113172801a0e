"""Interactive figures for the notebooks: thin front-ends over `labsupport.estimate` and recorded runs.

A widget holds no formula of its own. Every number it shows is computed by `estimate/` (the same
functions the CLI and the notebooks call) or read from a run directory that a launch wrote, so a
slider can never disagree with a table printed two cells above it.

Each widget comes with a function that draws the same picture as a static matplotlib Figure,
for the places where widgets do not run: GitHub's notebook viewer, nbval, a PDF export.

  memory        memory breakdown per device: params, grads, optimizer states, activations
                (`MemoryWidget`, `memory_figure`, `measured_vs_predicted_figure`)
  collectives   step through a collective's schedule, rank by rank and chunk by chunk
                (`CollectivesWidget`, `collectives_figure`)
  timeline      one recorded step per rank: compute, each bucket's all-reduce, hidden vs exposed
                (`TimelineWidget`, `timeline_figure`)
  comm_counter  tensor parallelism's collectives of one step, their time on a machine beside the compute,
                a run's counts beside the prediction (`CommCounterWidget`, `comm_figure`)
  pipeline      a pipeline schedule's Gantt chart, its bubble beside the formula, throughput against m and p
                (`PipelineWidget`, `gantt_figure`, `throughput_figure`)
  rank_grid     the dp x pp x tp ranks on nodes, coloured by group, the groups that cross nodes and a run's
                bytes inside and across them (`RankGridWidget`, `rank_grid_figure`, `layout`)
  ring          ring attention's K/V blocks stepped around cp ranks: blocks computed or skipped by the causal
                mask, the online softmax's merge, plain vs balanced split (`RingWidget`, `ring_figure`)
  planner       the fastest dp x tp x pp layouts of a model on a cluster, why the best wins, where each one's
                step time goes, a random search's trajectory (`PlannerWidget`, `planner_figure`, `plan_for`)

Import the submodule you need, e.g. `from labsupport.widgets.memory import MemoryWidget`;
nothing is imported here, so loading one widget never pulls in the others' dependencies.
Nothing under `widgets/` imports torch, nor anything from `labsupport.parallel` (tests/test_imports.py).
"""
