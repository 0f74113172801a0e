"""A DeepSpeed configuration (the ds_config dict, or its JSON file) from plain numbers.

Without torch or DeepSpeed, so `labsupport plan --emit deepspeed` can write one as cheaply as the
`deepspeed` strategy builds one. The keys are those of DeepSpeed's configuration documentation
(https://www.deepspeed.ai/docs/config-json/):

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x DP degree
    gradient_clipping                   the max global norm (0: none)
    zero_optimization.stage             0 (DDP) .. 3; reduce_bucket_size, allgather_bucket_size and
                                        stage3_prefetch_bucket_size in elements, not bytes;
                                        overlap_comm, contiguous_gradients
    bf16.enabled / fp16.enabled         16-bit training; fp16 with dynamic loss scaling (loss_scale 0:
                                        start at 2**initial_scale_power, halve on an overflow, double
                                        after loss_scale_window clean steps; hysteresis,
                                        min_loss_scale)
    optimizer.type / optimizer.params   DeepSpeed builds AdamW itself (one weight decay for every
                                        parameter); the `deepspeed` strategy leaves it out and passes
                                        the loop's optimizer (parallel/optim.py, decay groups) instead
"""
from __future__ import annotations


def ds_config(micro_batch: int, grad_accum: int, dp: int, zero: int, *,
              reduce_bucket: int = 500_000_000, allgather_bucket: int = 500_000_000,
              overlap_comm: bool = False, contiguous_gradients: bool = True, grad_clip: float = 0.0,
              dtype: str = "fp32", lr: float | None = None, weight_decay: float = 0.0,
              betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> dict:
    """The ds_config for `dp` data-parallel ranks, each running `grad_accum` micro-batches of
    `micro_batch` sequences per step, with ZeRO stage `zero`. `lr` given: an optimizer section with
    the loop's AdamW recipe (betas: parallel/optim.py's BETAS, as GPT-3; tests check they agree)."""
    if dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"dtype must be fp32, bf16 or fp16 (got {dtype!r})")
    config = {
        "train_batch_size": micro_batch * grad_accum * dp,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {
            "stage": zero,
            "reduce_bucket_size": reduce_bucket,
            "allgather_bucket_size": allgather_bucket,
            "overlap_comm": overlap_comm,
            "contiguous_gradients": contiguous_gradients,
            **({"stage3_prefetch_bucket_size": allgather_bucket} if zero == 3 else {}),
        },
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if lr is not None:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                          "weight_decay": weight_decay}}
    return config
