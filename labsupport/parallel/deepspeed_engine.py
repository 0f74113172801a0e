"""DeepSpeed's ZeRO, the reference the workshop's Frontier runs use: the same loop, with the
module and the loop's AdamW handed to `deepspeed.initialize`.

The ds_config comes from the ParallelConfig and the step's shape (labsupport/ds_config.py):
ZeRO stage `--zero` (1 when not given, as in the workshop's runs; 2 and 3 when asked), the
micro-batch and the accumulation steps of the loop, our bucket size (`--bucket-mb`, in fp32
elements) for the reduce and all-gather buckets, contiguous gradients, no overlap (there is no
second stream on a CPU), and `gradient_clipping` = `--grad-clip`; ZeRO-3 shards every parameter
and releases it after each use, as ours does (`make_ds_config`). We pass our optimizer (the decay
groups of parallel/optim.py), so the update is the loop's recipe; under ZeRO-1/2 DeepSpeed wraps
it around an fp32 copy of this rank's partition, which AdamW updates.

DeepSpeed's loop is `engine(x); engine.backward(loss); engine.step()` for every micro-batch:
`backward` divides by the accumulation steps and reduces the gradients (ZeRO-2/3: into this
rank's partition), and `step` steps only on the last one, clipping inside it. So the norm is
known only once the step is taken: `forward_backward` runs DeepSpeed's loop whole, the norm the
loop asks of `clip_grad_norm_` is the engine's (before clipping), and the optimizer the loop
holds only lends its parameter groups (the loop sets the learning rate there) and its state.

Under `--dtype fp16` DeepSpeed scales the loss itself (the ds_config's fp16 section): the engine
holds the module in fp16 and, under ZeRO-1/2, an fp32 copy of this rank's partition that AdamW
updates; `backward` multiplies the loss by its scale S, and `step` unscales, agrees on an overflow
over the ranks, skips the update and halves S, or steps. So no LossScaler of ours here (the loop's
autocast changes nothing on an fp16 module: measured, the same numbers with and without it):
`EngineLossScale` only reports the engine's S and skip to the loop's metrics. Its rule is set
to GradScaler's (`make_loss_scaler`): halve on every overflow (hysteresis 1, not DeepSpeed's 2),
double after 2000 clean steps, start at `--loss-scale` (2^16 by default). Losses are computed from
fp32 logits, as autocast computes them: in fp16, S times the loss overflows at once (4.2 x 2^14 >
65,504), and a validation loss would be rounded to fp16 (2^-9 apart near 3).

DeepSpeed's collectives go through `deepspeed.comm` to torch.distributed, not through
labsupport.comm: its torch backend's methods are wrapped to count each call with labsupport.comm
first (`count_deepspeed_calls`), so a run reports its traffic as ours do. A checkpoint is DeepSpeed's
own (`EngineCheckpoint`, which accelerate-deepspeed shares); the loop's file beside it holds the whole
model, so it loads into `single`.
`import deepspeed` takes over a second, so only this module imports it, when the strategy runs.
"""
from __future__ import annotations

import logging
import math
import os
import warnings
from contextlib import nullcontext

import torch

if not torch.cuda.is_available():  # the runtime's choice too; said here, DeepSpeed need not warn that it guessed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.utils import logger as ds_logger  # noqa: E402

from .. import comm  # noqa: E402
from ..ds_config import ds_config  # noqa: E402
from .optim import adamw  # noqa: E402
from .strategy import Strategy  # noqa: E402

TAG = "deepspeed"  # the folder DeepSpeed saves into, inside the loop's step directory

# Which of DeepSpeed's C++ ops this machine could build: DeepSpeed probes every one with the
# compiler on first asking (linker errors on stderr where a library such as libaio is missing), and
# on a CPU its torch backend would then build a shared-memory all-reduce that only inference calls.
# This strategy builds none (AdamW is torch's), so say so instead of probing.
deepspeed.ops.__compatible_ops__ = {}
# DeepSpeed calls torch's all_gather_into_tensor and reduce_scatter_tensor, which torch 2.13 calls
# deprecated: not ours to fix
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                                          "is deprecated")

# DeepSpeed's torch backend (deepspeed.comm's door to torch.distributed): method -> our op, its
# arguments in order, and the one whose bytes are the payload, as labsupport.comm counts its own calls
COUNTED = {"all_reduce": ("all_reduce", "tensor op group", "tensor"),
           "all_reduce_coalesced": ("all_reduce", "tensors op group", "tensors"),
           "reduce": ("reduce", "tensor dst op group", "tensor"),
           "broadcast": ("broadcast", "tensor src group", "tensor"),
           "reduce_scatter": ("reduce_scatter", "output input_list op group", "input_list"),
           "reduce_scatter_tensor": ("reduce_scatter", "output_tensor input_tensor op group", "input_tensor"),
           "all_gather": ("all_gather", "tensor_list tensor group", "tensor_list"),
           "all_gather_into_tensor": ("all_gather", "output_tensor input_tensor group", "output_tensor"),
           "all_gather_base": ("all_gather", "output_tensor input_tensor group", "output_tensor"),
           "all_gather_coalesced": ("all_gather", "output_tensors input_tensors group", "output_tensors")}

WORLD = [None]  # what DeepSpeed's world group is counted as: the data-parallel group of the strategy last made


def count_deepspeed_calls(world) -> None:
    """Have labsupport.comm count every collective DeepSpeed starts: each method of its torch
    backend that talks is wrapped (once per process) to count its call first. DeepSpeed's calls on
    the world (ZeRO-3's pass no group) are counted on `world`, this strategy's data-parallel group."""
    WORLD[0] = world
    backend = deepspeed.comm.comm.cdb
    for method, (op, names, payload) in COUNTED.items():
        original = getattr(backend, method)
        if getattr(original, "counted", False):
            continue

        def counted(*args, _original=original, _op=op, _names=names.split(), _payload=payload, **kwargs):
            bound = {**dict(zip(_names, args)), **kwargs}
            tensors = bound[_payload] if isinstance(bound[_payload], (list, tuple)) else [bound[_payload]]
            group = bound.get("group")
            world = group is None or group is torch.distributed.group.WORLD
            comm.count(_op, sum(t.numel() * t.element_size() for t in tensors), WORLD[0] if world else group)
            return _original(*args, **kwargs)
        counted.counted = True
        setattr(backend, method, counted)


class EngineCheckpoint:
    """The checkpoint of a strategy that trains through DeepSpeed's engine (`self.engine`: this module's
    and accelerate-deepspeed's): DeepSpeed's own, `save_checkpoint` into the step's directory and
    `load_checkpoint` on resume (every rank its partition of the optimizer states and the fp32 weights).
    The loop's file beside it holds the whole model, for `single` to load; a resume reads DeepSpeed's."""

    def model_state(self, model) -> dict:
        """The whole model (ZeRO-3 gathers each partitioned parameter for the copy)."""
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.config.zero == 3):
            return {name: t.detach().clone() for name, t in model.state_dict().items()}

    def load_model_state(self, model, state) -> None:
        """Nothing: DeepSpeed's own checkpoint (`load_state`) holds the weights it trains."""

    def optimizer_state(self, optimizer) -> dict:
        return {}

    def load_optimizer_state(self, optimizer, state) -> None:
        """Nothing: in DeepSpeed's own checkpoint."""

    def save_state(self, directory) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False)

    def load_state(self, directory) -> None:
        self.engine.load_checkpoint(str(directory), tag=TAG)


class DeepSpeedZeRO(EngineCheckpoint, Strategy):
    name = "deepspeed"
    fp16 = True  # DeepSpeed's own loss scaling (make_loss_scaler)

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.zero == 0:
            return ["strategy 'deepspeed' without ZeRO is DDP, whose step DeepSpeed leaves to the torch "
                    "optimizer (no global norm to report): use --zero 1, 2 or 3, or --strategy torch-ddp"]
        try:  # DeepSpeed's own parser of the ZeRO section (the batch sizes are the loop's, always consistent)
            DeepSpeedZeroConfig(**cls.make_ds_config(config, 1, microbatches or 1, 1.0)["zero_optimization"])
        except ValueError as e:  # pydantic's ValidationError
            error = e.errors()[0]
            return [f"strategy 'deepspeed': DeepSpeed refuses the ds_config: zero_optimization."
                    f"{'.'.join(map(str, error['loc']))} = {error['input']!r}: {error['msg']} (see --bucket-mb)"]
        return []

    @classmethod
    def fp16_problem(cls, device_type: str) -> str | None:
        """DeepSpeed keeps the whole module in fp16 and asks its accelerator whether the device computes
        in fp16; on a CPU that is oneDNN's fp16 support (AVX512-FP16 or AMX-FP16), which most laptops
        and many servers lack, and `deepspeed.initialize` would fail on every rank."""
        accelerator = get_accelerator()
        if accelerator.device_name() == device_type and not accelerator.is_fp16_supported():
            return (f"--dtype fp16: DeepSpeed {deepspeed.__version__} does not support fp16 on this {device_type} "
                    f"(its {type(accelerator).__name__} says no: on a CPU it needs AVX512-FP16 or AMX-FP16); "
                    "use --dtype bf16, or fp16 with one of our strategies (e.g. --strategy zero1)")
        return super().fp16_problem(device_type)

    @staticmethod
    def make_ds_config(config, micro_batch: int, accumulation: int, grad_clip: float) -> dict:
        """`ds_config` for this run. ZeRO-3 shards every parameter and releases it after each use, as
        ours: DeepSpeed's defaults keep parameters under 1e5 elements whole on every rank
        (stage3_param_persistence_threshold) and gathered ones alive for reuse (stage3_max_reuse_distance,
        stage3_max_live_parameters, 1e9 elements): on TinyGPT, all of them."""
        bucket = int(config.bucket_mb * 2**20 / 4)  # fp32 elements
        ds = ds_config(micro_batch, accumulation, config.dp, config.zero, reduce_bucket=bucket,
                       allgather_bucket=bucket, grad_clip=grad_clip)
        if config.zero == 3:
            ds["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                                           stage3_max_live_parameters=0)
        return {**ds, "steps_per_print": 2**31 - 1}  # DeepSpeed's own progress lines: never

    def __init__(self, rt, config):
        super().__init__(rt, config)
        ds_logger.setLevel(logging.WARNING)  # each rank would log its config and its ZeRO setup
        self.engine = None

    def set_step(self, micro_batch: int, accumulation: int, grad_clip: float) -> None:
        self.ds_config = self.make_ds_config(self.config, micro_batch, accumulation, grad_clip)

    def make_loss_scaler(self, init_scale):
        """fp16: the ds_config's fp16 section with GradScaler's rule (module docstring); what the loop
        reads of the scale is the engine's."""
        self.ds_config["fp16"] = ds_config(1, 1, 1, self.config.zero, dtype="fp16")["fp16"]
        self.ds_config["fp16"].update(initial_scale_power=int(math.log2(init_scale or 2 ** 16)),
                                      hysteresis=1, loss_scale_window=2000)
        return EngineLossScale(self)

    def make_optimizer(self, model, lr, weight_decay):
        """The engine around `model` and the loop's AdamW; the module the loop holds stays `model`
        (ZeRO-3 partitions its parameters in place), and every hook below runs it through the engine."""
        self.engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=adamw(model.parameters(), lr, weight_decay),
            config=self.ds_config, dist_init_required=False)
        for group in (self.engine.data_parallel_group, self.engine.seq_data_parallel_group):  # DeepSpeed's own
            comm.name_group(group, "dp")
        count_deepspeed_calls(world=self.mesh.dp_group)  # dp-only: the world is the data-parallel group
        return LentOptimizer(optimizer)

    def forward_backward(self, model, batches, autocast=None):
        """DeepSpeed's loop over the micro-batches; the engine steps (and clips) after the last one."""
        losses = []
        for x, y in batches:
            with comm.phase("forward"), autocast or nullcontext():
                loss = self.loss_fn(self.engine(x).float(), y)  # fp16: see the module's docstring
            with comm.phase("backward"):
                self.engine.backward(loss)  # divided by the accumulation steps in there
            with comm.phase("optimizer"):
                self.engine.step()  # a no-op but on the last micro-batch
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def clip_grad_norm_(self, model, max_norm):
        """The global norm before clipping, as the engine measured it in its step."""
        return float(self.engine.get_global_grad_norm())

    @torch.no_grad()
    def evaluate_loss(self, model, x, y):
        return self.loss_fn(self.engine(x).float(), y)

    @torch.no_grad()
    def logits(self, model, idx):
        return self.engine(idx)

    def close(self, model) -> None:
        """Let go of the engine and of the process groups DeepSpeed keeps in its modules (the runtime's
        teardown wants no reference left to them: runtime.py says why)."""
        self.engine.destroy()
        self.engine = WORLD[0] = None
        deepspeed.utils.groups._release_process_group_references()


class LentOptimizer:
    """What the loop holds as its optimizer: the engine's parameter groups (where the loop sets
    the learning rate) and what AdamW keeps; zeroing and stepping are the engine's."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        """AdamW's moments and, under ZeRO-1/2, the fp32 copy of this rank's partition that AdamW
        updates (DeepSpeed keeps one even in fp32; the ZeRO paper counts it as optimizer state).
        ZeRO-3 in fp32 updates the partition itself. (What the memory measurement reads.)"""
        copies = getattr(self.optimizer, "single_partition_of_fp32_groups", [])
        return {**self.optimizer.state, **{("fp32 copy", i): {"param": t} for i, t in enumerate(copies)}}

    def zero_grad(self, set_to_none=True):
        """Nothing: the engine zeroes the gradients once it stepped."""

    def step(self):
        """Nothing: the engine stepped after the last micro-batch."""


class EngineLossScale:
    """What the loop reads of DeepSpeed's loss scaling under fp16 (loop.train_step, the metrics):
    the scale of this step's backward and whether the engine skipped the step. The engine unscales,
    steps and updates the scale itself, and its checkpoint holds the scale: the loop's calls do nothing."""

    def __init__(self, strategy):
        self.strategy = strategy  # its engine is made after this

    def get_scale(self) -> float:
        return float(self.strategy.engine.optimizer.loss_scale)

    @property
    def skipped(self) -> bool:
        return not self.strategy.engine.was_step_applied()

    def unscale_(self, optimizer):
        """Nothing: done in the engine's step."""

    def step(self, optimizer):
        """Nothing: done in the engine's step."""

    def update(self):
        """Nothing: done in the engine's step."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state) -> None:
        """Nothing: in DeepSpeed's own checkpoint."""
