"""Pure math about training: what a model costs before anything runs.

Every formula here cites the paper it comes from and has a test against a number printed in
that paper. The notebooks show these predictions beside what `labsupport.metrics` measures.

  shapes            ModelConfig (the GPT shape and the Llama family's options), the presets, their checks
  params            how many parameters a TinyGPT shape has (exact; active ones with experts), the 12 L d^2 rule
  flops             training FLOPs per token (6N + 12 L s d; a causal kernel's 6 L d (s + 1)), datasheet peaks, for MFU
  memory            bytes per device: model states (ZeRO stages), activations (Korthikanti et al.)
  offload           ZeRO-Offload: host bytes and PCIe traffic per step
  comm_cost         alpha-beta time of each collective (ring, tree, ...), nccl-tests bus bandwidth
  collective_steps  which chunk each rank sends at each step of each collective (runtime + widget)
  tp_comm           tensor (and sequence) parallelism's collectives per step (Shoeybi, Korthikanti)
  context           context parallelism: activations over cp, K/V blocks in flight, the ring's traffic (Liu et al.),
                    and a long sequence's memory per device, model states to logits
  experts           mixture-of-experts parameters (total, active) and expert parallelism's all-to-all (GShard)
  machines          node presets (Frontier, DGX A100 / H100): devices, links, peaks, memory
  devices           one accelerator's measured rates (matmul, memory, FlashAttention) for step_time
  step_time         a layer's compute time from its matmul shapes, attention kernel and bytes moved
  schedules         pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as action lists (runtime + widget)
  simulator         times a schedule: Gantt spans, bubble against (p - 1) / (v m), micro-batches in flight
  planner           ranks dp x tp x pp x micro-batch x ZeRO x recomputation layouts by predicted step time
  scaling           weak and strong scaling curves from the planner's model, beside the workshop's
  published         Narayanan et al.'s Table 1, and 27 measured runs (A100, H100, MI250X) with sources and layouts
  validation        the planner against those runs: plan --validate
  energy            compute-optimal tokens (Hoffmann et al.) and training energy (Patterson et al.)
  workshop          the workshop decks' runs and launch scripts as data, each fact citing its source

Nothing in this package imports torch: a planner for a 1T-parameter model must run on a laptop.
"""
