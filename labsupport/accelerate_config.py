"""An Accelerate config file (what `accelerate config` writes) read as `labsupport train` options.

`accelerate launch --config_file FILE` hands each rank FILE's plugin settings as environment
variables, which `Accelerator()` reads. Our `accelerate-fsdp` and `accelerate-deepspeed` make
their plugins from our options instead (on CPU they must force Accelerate's path), so before any
process starts the launcher reads FILE through Accelerate's own loader and turns the keys that
decide what runs into options, the same for every rank:

    distributed_type FSDP | DEEPSPEED                --strategy accelerate-fsdp | accelerate-deepspeed
    num_processes                                    the number of ranks
    fsdp_config.fsdp_sharding_strategy               --zero 3 | 2 | 0 (FULL_SHARD | SHARD_GRAD_OP | NO_SHARD)
    deepspeed_config.zero_stage                      --zero
    deepspeed_config.gradient_clipping               --grad-clip
    deepspeed_config.gradient_accumulation_steps     micro-batches per step: --micro-batch = global batch
                                                     / (ranks x steps)

What we do not run is refused, one line each: several machines, mixed precision, offloading,
FSDP2 (that is `torch-fsdp`). The other keys (wrap policy, prefetch, state-dict type) are what
the strategies do anyway: one FSDP unit per transformer block, whole state dicts.
"""
from __future__ import annotations

from accelerate.commands.config.config_args import load_config_from_file

from .parallel.accelerate_fsdp import SHARDING
from .parallel.config import ConfigError

STRATEGY = {"FSDP": "accelerate-fsdp", "DEEPSPEED": "accelerate-deepspeed"}


def options(path, global_batch: int) -> dict:
    """The options FILE sets, as `labsupport train` keywords plus `nproc`; a ConfigError naming every
    key we cannot run."""
    try:
        file = load_config_from_file(str(path))
    except (FileNotFoundError, TypeError, ValueError) as e:  # a missing file, an unknown key or value
        raise ConfigError([f"accelerate config {path}: {e}"]) from None
    where = f"accelerate config {path}"
    kind = file.distributed_type.value
    problems = []
    if kind not in STRATEGY:
        problems.append(f"{where}: distributed_type {kind}; labsupport launches FSDP or DEEPSPEED")
    if file.num_machines != 1:
        problems.append(f"{where}: num_machines {file.num_machines}; labsupport launches one machine")
    if str(file.mixed_precision) != "no":
        problems.append(f"{where}: mixed_precision {file.mixed_precision}; the equivalence with single is in fp32: 'no'")
    out = {"strategy": STRATEGY.get(kind), "nproc": file.num_processes}
    if kind == "FSDP":
        fsdp = file.fsdp_config or {}
        zero = {name: stage for stage, name in SHARDING.items()}
        sharding = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"))
        if sharding not in zero:
            problems.append(f"{where}: fsdp_sharding_strategy {sharding}; one of {', '.join(zero)}")
        if str(fsdp.get("fsdp_version", 1)) != "1":
            problems.append(f"{where}: fsdp_version {fsdp['fsdp_version']}; accelerate-fsdp is FSDP1 "
                            "(FSDP2 is --strategy torch-fsdp)")
        if fsdp.get("fsdp_offload_params"):
            problems.append(f"{where}: fsdp_offload_params true; labsupport does not offload")
        out["zero"] = zero.get(sharding)
    if kind == "DEEPSPEED":
        ds = file.deepspeed_config or {}
        for key in ("offload_optimizer_device", "offload_param_device"):
            if ds.get(key, "none") != "none":
                problems.append(f"{where}: {key} {ds[key]}; labsupport does not offload")
        out["zero"] = int(ds.get("zero_stage", 2))
        if "gradient_clipping" in ds:
            out["grad_clip"] = float(ds["gradient_clipping"])
        steps = int(ds.get("gradient_accumulation_steps", 1))
        if global_batch % (file.num_processes * steps):
            problems.append(f"{where}: gradient_accumulation_steps {steps} x num_processes {file.num_processes} "
                            f"does not divide --global-batch {global_batch}")
        else:
            out["micro_batch"] = global_batch // (file.num_processes * steps)
    if problems:
        raise ConfigError(problems)
    return out
