"""One parallel configuration for a run, checked once, before any process starts.

Every strategy reads its options from a `ParallelConfig`; none reads the command line. The
same object is built from `labsupport train` flags, from `train.run(...)` keywords and by
the benchmarks, and `check()` refuses a bad one with one line per mistake, naming the flag
(or keyword) to change. The degrees follow the rank grid of `mesh.py`:

    world size = dp x pp x cp x tp       (ep, expert parallel, divides dp: it borrows those ranks)

That product is the one check of the grid made here. Everything else is asked of whoever has the
constraint: each step of the composition (compose.py) checks its own options and what it cannot
combine with (`Step.problems`), whether it applies or not, so every strategy gets the steps'
checks of the shared flags; a strategy's name only says what it stands for (registry.py: `ddp`
needs dp above 1, `zero2` is --zero 2), and a reference strategy declares the degrees it splits
and checks its own limits (its class's `problems`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..grid import AXES
from .registry import STRATEGIES

DDP_MODES = ("naive", "flat", "bucketed")  # --ddp-mode: how DataParallel all-reduces (ddp.py)
# What a configuration may set above 1: the grid's axes, and two cuts of dp (experts; HSDP's replicas).
DEGREES = (*AXES, "ep", "dp_replicate")
AXIS_WORDS = {"dp": "data parallelism", "tp": "tensor parallelism", "pp": "pipeline parallelism",
              "cp": "context parallelism", "dp_replicate": "hybrid sharding (ZeRO-3 in replicas)"}  # (Entry.names)


def flag(degree: str) -> str:
    """The command-line flag of a degree: --dp, --dp-replicate."""
    return "--" + degree.replace("_", "-")


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
    cp: int = 1                      # context parallel: the sequence cut over cp ranks (ring attention)
    ep: int = 1                      # expert parallel: the experts spread over ep of the dp ranks
    zero: int | None = None          # None: not given, the strategy's default (registry)
    schedule: str = "1f1b"
    microbatches: int | None = None  # pipeline micro-batches per step (None: from --micro-batch, else pp)
    chunks: int = 1                  # model chunks per pipeline rank (interleaved 1F1B)
    sequence_parallel: bool = False
    ddp_mode: str = "bucketed"
    bucket_mb: float = 25.0
    find_unused_parameters: bool = False
    prefetch: bool = True            # zero3: all-gather the next unit while this one computes
    dp_replicate: int = 1            # zero3: replicas of dp / dp_replicate ranks each, sharding inside (HSDP)

    def __post_init__(self):
        """--zero not given is the name's stage: `zeroK` *is* ZeRO stage K (so the checkpoint layout
        records K), a name that leaves --zero free its default. A --zero given stays as given (a
        stage the name contradicts is refused by `problems`)."""
        entry = STRATEGIES.get(self.strategy)
        if self.zero is None:
            fixed = entry.zero if entry is not None else None
            object.__setattr__(self, "zero", fixed if fixed is not None else entry.default_zero if entry else 0)

    @classmethod
    def build(cls, world_size: int, strategy: str = "single", dp: int | None = None, tp: int = 1, pp: int = 1,
              **options) -> "ParallelConfig":
        """The configuration for `world_size` ranks: dp defaults to what tp and pp leave of the world."""
        if dp is None:
            dp = max(1, world_size // max(1, tp * pp * options.get("cp", 1)))
        return cls(strategy=strategy, dp=dp, tp=tp, pp=pp, **options)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def layout(self) -> dict:
        """What a checkpoint must match to be resumed: the strategy and the grid (and the model chunks
        per pipeline stage, which decide the layers each stage's file holds, where there are several)."""
        extra = {name: getattr(self, name) for name in ("chunks", "cp", "ep", "dp_replicate") if getattr(self, name) > 1}
        return {"strategy": self.strategy, "dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero, **extra}

    def to_dict(self) -> dict:
        return asdict(self)

    def problems(self, world_size: int, model=None, global_batch: int | None = None,
                 micro_batch: int | None = None) -> list[str]:
        """Every mistake, one line each; `model` is a ModelConfig with its vocabulary set. The steps
        check their own options, so this imports the composition (and torch) when it runs."""
        from .compose import Parallel, step_problems
        entry = STRATEGIES.get(self.strategy)
        if entry is None:
            return [f"unknown strategy {self.strategy!r}; available: {', '.join(STRATEGIES)}"]
        if min(getattr(self, axis) for axis in DEGREES) < 1:
            return [f"--dp, --tp, --pp, --cp, --ep and --dp-replicate must be >= 1, got {self._grid()} (--ep {self.ep}, "
                    f"--dp-replicate {self.dp_replicate})"]
        out = self._degree_problems(entry, world_size)
        zero = self._zero_problems(entry)
        out += zero
        batch = self._batch_problems(global_batch, micro_batch) if global_batch is not None else []
        microbatches = None  # per step, what a pipeline schedule runs: known once the batch is valid
        if global_batch is not None and not batch:
            microbatches = global_batch // self.dp // self.micro_batch_size(global_batch, micro_batch)
        # The steps see what the strategy would run: a degree a reference does not split (reported above)
        # as 1, a refused --zero as 0, so one mistake is one line.
        unsplit = {axis: 1 for axis in DEGREES if entry.splits is not None and axis not in entry.splits}
        out += step_problems(replace(self, **unsplit, **({"zero": 0} if zero else {})), model, microbatches)
        out += entry.load().problems(self, model, microbatches)
        if model is not None and model.experts and not entry.experts:
            out.append(f"--experts: {self.strategy} is a reference that knows no mixture of experts; "
                       "use one of ours (ddp)")
        return out + batch

    def _degree_problems(self, entry, world_size: int) -> list[str]:
        """The degrees multiply to the world size; a reference splits only what it can; a name of ours
        has the degrees it stands for above 1."""
        if entry.splits == () and world_size != 1:
            return [f"strategy {self.strategy!r} runs on one rank, but the run has {world_size}: name a parallel "
                    "strategy (e.g. --strategy ddp), or run it on one rank"]
        out = []
        if self.tp > world_size:
            out.append(f"--tp {self.tp} needs at least {self.tp} ranks, but the run has {world_size} (--nproc)")
        elif self.world_size != world_size:
            out.append(f"{self._grid()} = {self.world_size} ranks, but the run has {world_size} (--nproc); "
                       f"make dp x tp x pp{' x cp' * (self.cp != 1)} equal the number of ranks")
        if entry.splits:
            for axis in DEGREES:
                if axis not in entry.splits and getattr(self, axis) > 1:
                    uses = " and ".join(entry.splits)
                    out.append(f"strategy {self.strategy!r} splits over {uses} only, so {flag(axis)} must be 1 "
                               f"(got {getattr(self, axis)})")
        for axis in entry.names:
            if not out and getattr(self, axis) == 1:
                line = (f"strategy {self.strategy!r} is {AXIS_WORDS[axis]}, but this grid has {flag(axis)} 1 "
                        f"({self._grid()} on {world_size} rank{'s' * (world_size != 1)})")
                runs = [a for a in AXES if getattr(self, a) > 1]
                if axis == "dp_replicate":
                    line += ": give --dp-replicate R, R replicas of dp / R ranks each"
                elif runs and self.zero == 0:  # a name of ours for what does run
                    line += f"; name what runs: --strategy {({'dp': 'ddp'}.get(runs[0], runs[0]) if len(runs) == 1 else '3d')}"
                out.append(line)
        return out

    def _zero_problems(self, entry) -> list[str]:
        """--zero against the stage the name fixes (ZeRO's own needs are its step's, zero.py)."""
        if self.zero not in (0, 1, 2, 3):
            return [f"--zero must be 0, 1, 2 or 3, got {self.zero}"]
        if entry.zero == 0 and self.zero:
            return [f"strategy {self.strategy!r} does not shard with ZeRO, so --zero {self.zero} would be ignored; "
                    f"use --strategy zero{self.zero}, or leave --zero out"]
        if entry.zero is not None and self.zero != entry.zero:
            other = f"zero{self.zero}" if self.zero else "ddp"
            return [f"strategy {self.strategy!r} is ZeRO stage {entry.zero}, but --zero {self.zero} was given; "
                    f"leave --zero out or use --strategy {other}"]
        return []

    def check(self, world_size: int, model=None, global_batch: int | None = None,
              micro_batch: int | None = None) -> None:
        problems = self.problems(world_size, model, global_batch, micro_batch)
        if problems:
            raise ConfigError(problems)

    def _grid(self) -> str:
        cp = f" x --cp {self.cp}" if self.cp != 1 else ""
        return f"--dp {self.dp} x --tp {self.tp} x --pp {self.pp}{cp}"

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
        return []
