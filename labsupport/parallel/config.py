"""One parallel configuration for a run, checked once, before any process starts.

Every strategy reads its options from a `ParallelConfig`; none reads the command line. The
same object is built from `labsupport train` flags, from `train.run(...)` keywords and by
the benchmarks, and `check()` refuses a bad one with one line per mistake, naming the flag
(or keyword) to change. The degrees follow the rank grid of `mesh.py`:

    world size = dp x pp x tp
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..estimate.schedules import SCHEDULES

DDP_MODES = ("naive", "flat", "bucketed")
AXES = ("dp", "tp", "pp")


class ConfigError(ValueError):
    """Bad parallel settings; the message has one line per mistake."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ParallelConfig:
    """How a run is split over ranks, and the options of the strategy that splits it."""

    strategy: str = "single"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int | None = None          # None: not given, the strategy's default (registry)
    schedule: str = "1f1b"
    microbatches: int | None = None  # pipeline micro-batches per step (None: from --micro-batch, else pp)
    chunks: int = 1                  # model chunks per pipeline rank (interleaved 1F1B)
    sequence_parallel: bool = False
    ddp_mode: str = "bucketed"
    bucket_mb: float = 25.0
    find_unused_parameters: bool = False
    prefetch: bool = True            # zero3: all-gather the next unit while this one computes

    def __post_init__(self):
        """`zeroK` *is* ZeRO stage K: a config naming it without --zero records stage K (in the
        checkpoint layout too). --zero itself is for strategies that combine ZeRO with more (3d)."""
        from . import STRATEGIES
        entry = STRATEGIES.get(self.strategy)
        if self.zero is None:
            object.__setattr__(self, "zero", entry.default_zero if entry is not None else 0)
        if entry is not None and entry.zero is not None and self.zero == 0:
            object.__setattr__(self, "zero", entry.zero)

    @classmethod
    def build(cls, world_size: int, strategy: str = "single", dp: int | None = None, tp: int = 1, pp: int = 1,
              **options) -> "ParallelConfig":
        """The configuration for `world_size` ranks: dp defaults to what tp and pp leave of the world."""
        if dp is None:
            dp = max(1, world_size // max(1, tp * pp))
        return cls(strategy=strategy, dp=dp, tp=tp, pp=pp, **options)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def layout(self) -> dict:
        """What a checkpoint must match to be resumed: the strategy and the grid (and the model chunks
        per pipeline stage, which decide the layers each stage's file holds, where there are several)."""
        chunks = {"chunks": self.chunks} if self.chunks > 1 else {}
        return {"strategy": self.strategy, "dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero, **chunks}

    def to_dict(self) -> dict:
        return asdict(self)

    def problems(self, world_size: int, model=None, global_batch: int | None = None,
                 micro_batch: int | None = None) -> list[str]:
        """Every mistake, one line each; `model` is a ModelConfig with its vocabulary set."""
        from . import STRATEGIES  # the registry says which axes each strategy splits
        out = []
        entry = STRATEGIES.get(self.strategy)
        if entry is None:
            return [f"unknown strategy {self.strategy!r}; available: {', '.join(STRATEGIES)}"]
        degrees = {axis: getattr(self, axis) for axis in AXES}
        if min(degrees.values()) < 1:
            return [f"--dp, --tp and --pp must be >= 1, got {self._grid()}"]
        if self.strategy == "single" and world_size != 1:
            out.append(f"strategy 'single' runs on one rank; use --nproc 1 (got {world_size})")
        elif self.tp > world_size:
            out.append(f"--tp {self.tp} needs at least {self.tp} ranks, but the run has {world_size} (--nproc)")
        elif self.world_size != world_size:
            out.append(f"{self._grid()} = {self.world_size} ranks, but the run has {world_size} (--nproc); "
                       "make dp x tp x pp equal the number of ranks")
        for axis in AXES:
            if axis not in entry.axes and degrees[axis] > 1 and self.strategy != "single":
                uses = " and ".join(entry.axes) or "nothing"
                out.append(f"strategy {self.strategy!r} splits over {uses} only, so --{axis} must be 1 "
                           f"(got {degrees[axis]})")
        if self.zero not in (0, 1, 2, 3):
            out.append(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        elif entry.zero is not None and self.zero != entry.zero:
            out.append(f"strategy {self.strategy!r} is ZeRO stage {entry.zero}, but --zero {self.zero} was given; "
                       f"leave --zero out or use --strategy zero{self.zero}")
        elif self.strategy == "3d" and self.zero > 1:
            out.append(f"strategy '3d' composes ZeRO-1 only (the optimizer states sharded over each DP group): "
                       f"use --zero 0 or 1, got --zero {self.zero}")
        elif self.strategy == "3d" and self.zero == 1 and self.dp < 2:
            out.append("--zero 1 shards the optimizer states over data-parallel ranks, but --dp is 1; "
                       "use --zero 0 or --dp 2 or more")
        elif self.zero and entry.zero is None and not entry.default_zero and self.strategy != "3d":
            out.append(f"strategy {self.strategy!r} does not shard with ZeRO, so --zero {self.zero} would be ignored; "
                       f"use --strategy zero{self.zero}, or leave --zero out")
        elif self.strategy == "accelerate-fsdp" and self.zero == 1:
            out.append("strategy 'accelerate-fsdp' has no ZeRO-1 (FSDP shards the gradients with the optimizer "
                       "states): use --zero 3 (FULL_SHARD, the default), 2 (SHARD_GRAD_OP) or 0 (NO_SHARD), "
                       "or --strategy torch-zero1")
        shards = entry.zero is not None or entry.default_zero > 0
        if shards and self.dp < 2 and not out:  # (a grid mistake already says more)
            out.append(f"strategy {self.strategy!r} shards over data-parallel ranks; on dp {self.dp} it would be a no-op "
                       "(each rank owning everything is 'single'), so use --nproc 2 or more")
        if self.ddp_mode not in DDP_MODES:
            out.append(f"--ddp-mode must be one of {', '.join(DDP_MODES)}, got {self.ddp_mode!r}")
        elif (entry.zero is not None or self.strategy == "3d" and self.zero) and self.ddp_mode != "bucketed":
            out.append(f"strategy {self.strategy!r} reduce-scatters DDP's buckets, so --ddp-mode must be bucketed "
                       f"(got {self.ddp_mode})")
        if not self.bucket_mb > 0:
            out.append(f"--bucket-mb must be > 0, got {self.bucket_mb:g}")
        if self.strategy == "3d" and self.sequence_parallel:
            out.append("strategy '3d' does not combine --sequence-parallel yet (activations between stages would "
                       "hold s/T positions); leave it out, or use --strategy tp")
        if self.schedule not in SCHEDULES:
            out.append(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.chunks < 1 or (self.microbatches is not None and self.microbatches < 1):
            out.append("--chunks and --microbatches must be >= 1")
        elif self.chunks > 1 and self.schedule != "interleaved":
            out.append(f"--chunks {self.chunks} needs --schedule interleaved (gpipe and 1f1b run one model chunk "
                       "per stage)")
        elif self.schedule == "interleaved" and (self.chunks < 2 or self.pp < 2):
            out.append(f"--schedule interleaved needs --pp 2 or more and --chunks 2 or more (got --pp {self.pp}, "
                       f"--chunks {self.chunks}); with one chunk per stage use --schedule 1f1b")
        if model is not None:
            out += self._model_problems(model)
        if global_batch is not None:
            out += self._batch_problems(global_batch, micro_batch)
        return out

    def check(self, world_size: int, model=None, global_batch: int | None = None,
              micro_batch: int | None = None) -> None:
        problems = self.problems(world_size, model, global_batch, micro_batch)
        if problems:
            raise ConfigError(problems)

    def _grid(self) -> str:
        return f"--dp {self.dp} x --tp {self.tp} x --pp {self.pp}"

    def _model_problems(self, model) -> list[str]:
        out = []
        for what, size in (("heads", model.heads), ("hidden size", model.hidden),
                           ("padded vocabulary", model.padded_vocab)):
            if size % self.tp:
                out.append(f"--tp {self.tp} must divide the model's {what} ({size})")
        stages = self.pp * self.chunks
        if model.n_layers % stages:
            more = " (each chunk needs at least one layer)" if stages > model.n_layers else ""
            out.append(f"--pp {self.pp} x --chunks {self.chunks} = {stages} pipeline chunks must divide "
                       f"the model's {model.n_layers} layers{more}")
        if self.sequence_parallel and model.seq_len % self.tp:
            out.append(f"--sequence-parallel needs --tp {self.tp} to divide the sequence length ({model.seq_len})")
        return out

    def micro_batch_size(self, global_batch: int, micro_batch: int | None = None) -> int:
        """Sequences per forward/backward: --micro-batch, else each data-parallel rank's share of
        the global batch cut into --microbatches, by default one per pipeline stage (the fewest
        that let every stage work at once; without a pipeline, the whole share)."""
        return micro_batch or global_batch // self.dp // (self.microbatches or self.pp)

    def _batch_problems(self, global_batch: int, micro_batch: int | None) -> list[str]:
        if global_batch < 1:
            return ["--global-batch must be >= 1"]
        share, micro = global_batch // self.dp, self.micro_batch_size(global_batch, micro_batch)
        divisible = [f"--global-batch {global_batch} must be divisible by micro-batch x data-parallel ranks "
                     f"({micro_batch or 'auto'} x {self.dp})"]
        if global_batch % self.dp:
            return divisible
        if self.microbatches is not None and share % self.microbatches:
            return [f"--microbatches {self.microbatches} must divide the {share} sequences "
                    f"each data-parallel rank gets per step"]
        if not micro_batch and self.microbatches is None and share % self.pp:
            return [f"the {share} sequences each data-parallel rank gets per step do not split into --pp {self.pp} "
                    "micro-batches (the default, one per stage); set --microbatches or --micro-batch"]
        if micro_batch and self.microbatches and micro_batch * self.microbatches != share:
            return [f"--micro-batch {micro_batch} x --microbatches {self.microbatches} must equal the {share} "
                    "sequences each data-parallel rank gets per step; give only one of them"]
        if micro < 1 or share % micro:
            return divisible
        m = share // micro  # micro-batches per step: what a pipeline schedule runs
        if self.schedule == "interleaved" and self.pp > 1 and m % self.pp:
            return [f"--schedule interleaved runs micro-batches in groups of --pp {self.pp}, but a step has {m}; "
                    f"set --microbatches to a multiple of {self.pp}"]
        if self.strategy == "torch-pp" and self.schedule != "gpipe" and m < self.pp:
            return [f"torch's {self.schedule} schedule needs at least --pp {self.pp} micro-batches per step, "
                    f"but a step has {m}; use --microbatches {self.pp} or more"]
        return []
