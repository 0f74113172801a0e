"""What a training step costs, measured: memory by category, tokens/s, MFU, and the JSONL writer.

Memory is counted by category because each parallelism attacks a different one: DDP none,
ZeRO the optimizer state, gradients and parameters, tensor/pipeline parallelism all of them
plus activations. The numbers come from the tensors themselves, so they hold on CPU too;
on CUDA the allocator's peak is reported beside them.

`overlap` (a recorded step's communication, hidden behind backward or exposed) is `trace.py`'s,
torch-free so the timeline widget can use it; it is importable from here too.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager

import torch

from .estimate.flops import peak_tflops, training_flops_per_token
from .trace import overlap  # noqa: F401  (re-exported: the notebooks import it from here)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (a tied weight counts once); of a DTensor
    (FSDP2's sharded parameters, their gradients and moments) or a DeepSpeed ZeRO-3 parameter,
    the shard this rank holds."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # a DTensor, by duck type (torch.distributed.tensor is not imported here)
            t = t.to_local()
        t = getattr(t, "ds_tensor", t)  # a parameter DeepSpeed's ZeRO-3 partitioned: the partition held
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def param_bytes(model) -> int:
    return tensor_bytes(p for p in model.parameters())


def grad_bytes(model, optimizer=None) -> int:
    """The model's gradients, and those the optimizer holds for its own tensors (a ZeRO-2
    optimizer keeps only this rank's shard of the gradients); shared storage counts once."""
    held = [p.grad for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    return tensor_bytes([*(p.grad for p in model.parameters()), *held])


def optimizer_bytes(optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if torch.is_tensor(v))


class _Saved:
    """What autograd keeps instead of a saved tensor while a meter runs: the tensor, and a
    note to the meter when autograd lets go of it (after its backward)."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class ActivationMeter:
    """Bytes autograd holds for backward: live now (`bytes`) and at most (`peak`).

    Uses `torch.autograd.graph.saved_tensors_hooks`: every tensor a forward op keeps for its
    backward passes through `pack` and is counted (once per storage); when backward frees it,
    it leaves the count. So over several micro-batches `peak` is what was in flight at once:
    one micro-batch's worth when each backward follows its forward, m of them under a
    pipeline's all-forward-all-backward schedule.

    Parameters are not activations: a saved tensor that is a parameter or a view of one is
    left out, whatever storage the parameter has at that moment (a ZeRO-3 parameter gathered
    just for this layer is still the parameter). Under autocast the low-precision copies of
    the weights that matmuls keep are counted: they are made per forward, like activations.
    """

    def __init__(self):
        self._live: dict = {}  # storage key -> [bytes, saved tensors using it]
        self.bytes = 0
        self.peak = 0

    @staticmethod
    def _is_parameter(t) -> bool:
        """A parameter, or a view of one (a linear layer saves its weight transposed)."""
        return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)

    def _pack(self, t):
        if self._is_parameter(t):
            return t
        local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: its local part
        if hasattr(local, "_get_acs_underlying_tensor"):  # torch's AsyncCollectiveTensor, a functional collective's
            local = local._get_acs_underlying_tensor()     # output (DTensor's all-reduce): a wrapper of this buffer
        storage = local.untyped_storage()
        key = (storage.data_ptr(), t.device)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [storage.nbytes(), 0]
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key):
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self._live[key]

    @contextmanager
    def measure(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


def cpu_peak_flops(n: int = 1024, repeats: int = 5) -> float:
    """Achievable fp32 matmul FLOP/s of this CPU (best of a few runs), the CPU's 'peak' for MFU.

    CPUs publish no single peak a laptop user can look up, so we measure what a large
    matmul reaches with the threads this rank has; MFU on CPU is relative to that.
    """
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def device_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """Peak FLOP/s used for MFU and a label saying where it came from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peaks = peak_tflops(name)
        if peaks is None:
            return float("nan"), f"unknown GPU {name!r}: no peak in the table"
        half = dtype in (torch.bfloat16, torch.float16)  # the datasheets' dense fp16 and bf16 peaks are equal
        return (peaks[1] if half else peaks[0]) * 1e12, f"{name} datasheet {'bf16/fp16' if half else 'fp32'}"
    return cpu_peak_flops(), "CPU: measured fp32 matmul throughput of this rank's threads"


def mfu(tokens_per_s: float, cfg, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over peak (PaLM, Chowdhery et al. 2022, App. B)."""
    return tokens_per_s * training_flops_per_token(cfg) / peak_flops


class JsonlWriter:
    """One JSON object per line, flushed at once so a killed run keeps what it wrote."""

    def __init__(self, path):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a", encoding="utf-8")

    def write(self, record: dict):
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self):
        self._f.close()
