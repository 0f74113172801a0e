"""The workshop's runs, as its decks and its launch scripts state them: the one place they live.

Notebooks, exercises and tests read these instead of restating a number. Each fact carries where
it comes from, in the source's own words where it has some:

  PART_III  the "AI for Science at Scale" Part III deck (Dash et al. 2023, "Optimizing Distributed
            Training on Frontier for Large Language Models", arXiv:2312.12705, as the deck prints it):
            Table V (the DeepHyper search space), Table VI (the chosen layouts), Fig. 12 and 13
            (weak and strong scaling), the energy estimates and the "Hands On" slides.
  FORK      the deck's hands-on repository, sajal-vt/Megatron-DeepSpeed-ORNL, branch FA2 (the deck:
            "git switch FA2") at 03325d4: the `launch_gpt*_bf16.slurm` scripts and their DeepSpeed configs,
            and beside them a `launch_gpt_srun.frontier` no deck names; its branch frontier-sd (531936f)
            for the DeepHyper hands-on, `launch_dh.frontier` and `dh_utils.py`.
  PART_II   olcf/ai-training-series at e6452a3, ai_at_scale_part_2/megatron_examples/Megatron-DeepSpeed-ORNL:
            the Part II deck's 3D hands-on, `sbatch launch_gpt22b_srun.frontier`, and beside it
            `launch_gpt175b_srun.frontier`, `launch_gpt1T_srun.frontier` and `launch_gpt_srun.frontier`
            (the same files as on the fork's frontier-sd branch, 531936f), which no deck names.
  DASH_2023 the paper itself (arXiv:2312.12705), for the throughput it measured, which the deck's Fig. 11
            plots without readable numbers.

Where two sources disagree (Table VI's batch is per replica, the scripts' `--global-batch-size` is
global; a script named `_bf16` that passes `--fp16`), both are kept and the disagreement is said.
"""
from __future__ import annotations

from dataclasses import dataclass

GCDS_PER_NODE = 8        # every script: `srun ... --ntasks-per-node=8 --gpus-per-node=8`

# Every run the planner is compared with (HANDS_ON, PART_II_22B, Table VI's) is `pretrain_gpt_deepspeed.py ...
# --deepspeed` with a ZeRO stage in its config: DeepSpeed's optimizer, not Megatron's, holds the fp32 master
# weights and Adam's moments, so ZeRO's 16 bytes per parameter apply (2 + 2 + K = 12), not Megatron's own fp16
# recipe's 20. (PART_II_SRUN's two scripts pass no --deepspeed: Megatron's own optimizer, not compared here.)
PLANNER_PRECISION = "mixed"

PART_III = "Part III deck (Dash et al. 2023, arXiv:2312.12705)"
FORK = "sajal-vt/Megatron-DeepSpeed-ORNL@FA2 (03325d4)"
FORK_SD = "sajal-vt/Megatron-DeepSpeed-ORNL@frontier-sd (531936f)"
PART_II = "olcf/ai-training-series@e6452a3, ai_at_scale_part_2/megatron_examples/Megatron-DeepSpeed-ORNL"
DASH_2023 = "Dash et al. 2023, arXiv:2312.12705"


def _recompute(checkpoint_activations: bool) -> str:
    """Megatron's `--checkpoint-activations` keeps each layer's input and recomputes the whole layer
    (`--checkpoint-num-layers` 1): the planner's "full" recomputation."""
    return "full" if checkpoint_activations else "none"


@dataclass(frozen=True)
class BestLayout:
    """A column of Table VI ("Best parameters for training a 175B model and a 1T model"), the layout
    of the paper's scaling runs. Its GBS is a batch per replica (one pipeline of tp x pp GCDs):
    Fig. 12, "Weak scaling ... by keeping per replica batch-size fixed at 640" (175B), "at 1600" (1T)."""

    model: str                  # labsupport preset with the deck's shape
    tp: int
    pp: int
    micro_batch: int
    per_replica_batch: int      # Table VI's "GBS"
    zero: int                   # "ZeRO Stage"
    flash_attention: str        # "Flash Attention": v2
    precision: str              # "Precision": fp16
    checkpoint_activations: bool

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def recompute(self) -> str:
        return _recompute(self.checkpoint_activations)

    def layout(self) -> dict:
        """The planner's keywords for this layout (`scaling`'s `layout`)."""
        return dict(tp=self.tp, pp=self.pp, micro_batch=self.micro_batch, zero=self.zero, recompute=self.recompute)


TABLE_VI = {
    "175b": BestLayout("175b", tp=4, pp=16, micro_batch=1, per_replica_batch=640, zero=1, flash_attention="v2",
                       precision="fp16", checkpoint_activations=True),
    "1t": BestLayout("1t", tp=8, pp=64, micro_batch=1, per_replica_batch=1600, zero=1, flash_attention="v2",
                     precision="fp16", checkpoint_activations=True),
}


@dataclass(frozen=True)
class StrongScaling:
    """Fig. 13's caption, read apart from the 1T caption it is interleaved with in the deck: "Strong
    scaling of 175b model training by keeping the total batch size fixed at 8000. The strong scaling
    efficiency at 1024 GPUs is 89.93%", and for 1T "a total batch-size fixed at 8016 ... at 3072 GPUs
    is 87.05%". The GPU count each efficiency is measured against is not printed."""

    model: str
    global_batch: int
    gpus: int
    efficiency: float


STRONG_SCALING = {
    "175b": StrongScaling("175b", global_batch=8000, gpus=1024, efficiency=0.8993),
    "1t": StrongScaling("1t", global_batch=8016, gpus=3072, efficiency=0.8705),
}

# The paper's abstract: "100% weak scaling efficiency" for both models; the deck's Fig. 12 plots it
# without readable numbers.
WEAK_SCALING_EFFICIENCY = 1.0

# Table V, "Hyperparameter Tuning for 175B Model": the space DeepHyper searched (`sbatch
# --reservation=ai launch_dh.frontier` on the fork's frontier-sd branch, the deck's hands-on).
TABLE_V = dict(pp=(1, 2, 4, 8, 12, 16), tp=(1, 2, 4, 8), micro_batch=(4, 20),   # "MBS in [4, 20]"
               gradient_accumulation=(5, 10), zero1=(True, False), nodes=(12, 16))

# The DeepHyper hands-on ("Find the best strategy for training a 22B model": `git switch frontier-sd`,
# `sbatch --reservation=ai launch_dh.frontier`), as its files on FORK_SD have it: `launch_dh.frontier`
# asks for `#SBATCH -N 8`; `main_dh_centralized.py` runs each sample on 32 GCDs and maximises the
# "TFLOPs" it parses from the run's log; `dh_utils.py` maps the sampled indices to tp and pp in
# (1, 2, 4, 8), sets the global batch to 10 x dp x mbs (10 micro-batches per pipeline) and launches
# `--num-layers 24 --hidden-size 2064 --num-attention-heads 24 --train-iters 10`: not the 22B shape.
DEEPHYPER_HANDS_ON = dict(source=FORK_SD, nodes=8, gpus_per_sample=32, tp=(1, 2, 4, 8), pp=(1, 2, 4, 8),
                          micro_batch=(10, 20), microbatches=10, layers=24, hidden=2064, heads=24, iterations=10,
                          objective="TFLOPs")


# The three places the workshop's Megatron launch scripts live, by a short name.
SOURCE_NAMES = {FORK: "FA2", FORK_SD: "frontier-sd", PART_II: "Part II"}


class _MaxConnections:
    """What `export CUDA_DEVICE_MAX_CONNECTIONS=1` does for a launch, from the flags the fork's `validate_args` reads
    (MAX_CONNECTIONS_CHECK). Needs `tp` (a size, or the sizes a search samples), `deepspeed`, `entry`,
    `entry_in_repository`, `exports_max_connections` and `source`."""

    @property
    def where(self) -> str:
        return SOURCE_NAMES[self.source]

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return self.tp if isinstance(self.tp, tuple) else (self.tp,)

    @property
    def async_tp_allreduce(self) -> bool:
        """Whether Megatron's asynchronous TP all-reduce runs (MAX_CONNECTIONS_CHECK): the fork turns it off
        under --deepspeed, and a TP layer uses it only in a TP group of more than one rank."""
        return not self.deepspeed and max(self.tp_sizes) > 1

    @property
    def requires_max_connections(self) -> bool:
        """Whether the fork refuses (or, for a script that cannot start at all, would refuse) to start unless
        CUDA_DEVICE_MAX_CONNECTIONS is 1: without --deepspeed the asynchronous all-reduce's flag keeps its default,
        on, and `validate_args` checks the flag, whatever the TP size. None of the scripts passes
        --sequence-parallel, the check's other case."""
        return not self.deepspeed

    def max_connections(self) -> str:
        """One account of what `export CUDA_DEVICE_MAX_CONNECTIONS=1` does for this launch."""
        exported = "exports it" if self.exports_max_connections else "does not export it"
        if self.deepspeed:
            return (f"--deepspeed: the fork turns the asynchronous TP all-reduce off, so nothing in the fork relies on "
                    f"the order the variable gives, and the fork does not require it (where the runtime honours it, "
                    f"it still puts the process's streams on one hardware queue); the script {exported}")
        refuse = "refuses" if self.entry_in_repository else "would refuse"
        unable = ("" if self.entry_in_repository else
                  f" (this script cannot start at all: its {self.entry} is in neither repository)")
        if self.async_tp_allreduce:
            return (f"no --deepspeed, TP {self.tp}: the backward of each column-parallel layer (QKV, the MLP's first) "
                    f"and of the LM head starts the all-reduce of its input's gradient and computes its weight's "
                    f"gradient meanwhile, counting on one hardware queue to start the all-reduce first (for speed, not "
                    f"correctness); the fork {refuse} to start unless the variable is 1{unable}, and the script "
                    f"{exported}")
        return (f"no --deepspeed, TP 1: no TP all-reduce to order, yet the fork {refuse} to start unless the variable "
                f"is 1{unable}; the script {exported}")


@dataclass(frozen=True)
class Script(_MaxConnections):
    """A launch script the workshop ran, with what it passes to Megatron-DeepSpeed and DeepSpeed."""

    path: str                   # file, in `source`
    source: str
    deck: str                   # the deck's words that introduce it
    model: str                  # labsupport preset with the script's layers and hidden size
    nodes: int                  # `#SBATCH -N`
    tp: int                     # --tensor-model-parallel-size
    pp: int                     # --pipeline-model-parallel-size
    heads: int                  # --num-attention-heads
    seq_len: int                # --seq-length
    micro_batch: int            # --micro-batch-size
    global_batch: int           # --global-batch-size
    zero: int                   # the DeepSpeed config's "zero_optimization" stage (0 without DeepSpeed)
    precision: str              # Megatron's flag: --fp16 or --bf16
    ds_config: str | None       # --deepspeed_config (None: the script passes no --deepspeed)
    ds_precision: str | None    # what that config enables
    flash_attention: str | None  # --use-flash-attn-v2
    checkpoint_activations: bool
    notes: str = ""
    clip_grad: float = 1.0      # --clip-grad: Megatron's default, which both 22B scripts pass explicitly
    deepspeed: bool = True      # --deepspeed: the fork then runs DeepSpeed's engine and turns Megatron's async TP
    #                             all-reduce off: nothing relies on CUDA_DEVICE_MAX_CONNECTIONS=1 there
    entry: str = "pretrain_gpt_deepspeed.py"   # the script srun starts
    entry_in_repository: bool = True           # whether `source` holds `entry`
    exports_max_connections: bool = True       # `export CUDA_DEVICE_MAX_CONNECTIONS=1`: every script here has it

    def megatron_flags(self) -> list[str]:
        """The script's Megatron flags that `labsupport plan --check-config` reads against its ds_config."""
        return [str(a) for a in ("--tensor-model-parallel-size", self.tp, "--pipeline-model-parallel-size", self.pp,
                                 "--micro-batch-size", self.micro_batch, "--global-batch-size", self.global_batch,
                                 "--clip-grad", self.clip_grad, f"--{self.precision}")] + ["--deepspeed"] * self.deepspeed

    @property
    def gpus(self) -> int:
        return self.nodes * GCDS_PER_NODE

    @property
    def dp(self) -> int:
        """Megatron's data-parallel size: what is left of the world after tp x pp."""
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        """Micro-batches per pipeline per step: global batch / (micro-batch x dp)."""
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def recompute(self) -> str:
        return _recompute(self.checkpoint_activations)

    def layout(self) -> dict:
        """The planner's keywords for this run (`planner.evaluate`'s, with dp). ZeRO on one
        data-parallel rank shards nothing, so the planner calls that stage 0."""
        return dict(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch=self.micro_batch,
                    zero=self.zero if self.dp > 1 else 0, recompute=self.recompute)


HANDS_ON = {
    "22b": Script("launch_gpt22b_bf16.slurm", FORK, "Train a 22B model on 2 nodes", "22b", nodes=2, tp=1, pp=8,
                  heads=48, seq_len=2048, micro_batch=1, global_batch=640, zero=1, precision="fp16",
                  ds_config="ds_config_16N_175B.json", ds_precision="fp16", flash_attention="v2",
                  checkpoint_activations=True,
                  notes="passes `--zero-stage 0`, a Megatron argument the fork reads only for ZeRO-3's parameter "
                        "gathering and optimizer statistics; DeepSpeed's engine gets the JSON config as it is, "
                        "stage 1"),
    "175b": Script("launch_gpt175b_bf16.slurm", FORK, "Train a 175B model on 16 nodes", "175b", nodes=16, tp=4,
                   pp=16, heads=96, seq_len=4096, micro_batch=1, global_batch=640, zero=1, precision="fp16",
                   ds_config="ds_config_16N_175B.json", ds_precision="fp16", flash_attention="v2",
                   checkpoint_activations=True,
                   notes="sequences of 4096 tokens (`--seq-length 4096`), twice the preset's 2048"),
    "1t": Script("launch_gpt1T_bf16.slurm", FORK, "Train a 1T model on 128 nodes", "1t", nodes=128, tp=4, pp=128,
                 heads=200, seq_len=2048, micro_batch=1, global_batch=1024, zero=1, precision="bf16",
                 ds_config="ds_config_128N_1T_fp16.json", ds_precision="fp16", flash_attention="v2",
                 checkpoint_activations=True,
                 notes="200 heads of 128 (the preset: 128 of 200, the same parameters); passes `--bf16` to "
                       "Megatron while its DeepSpeed config enables fp16"),
}

# The Part II deck's 3D hands-on: "sbatch launch_gpt22b_srun.frontier", "Enable 3D parallelism and
# change model-size in the launch script", its snippet adding `--model-size 175B` to the 22B shape.
PART_II_22B = Script(
    "launch_gpt22b_srun.frontier", PART_II, "sbatch launch_gpt22b_srun.frontier", "22b", nodes=4, tp=4, pp=8,
    heads=96, seq_len=2048, micro_batch=2, global_batch=20, zero=1, precision="fp16",
    ds_config="ds_config_4N_22B.json", ds_precision="fp16", flash_attention=None, checkpoint_activations=True,
    notes="96 heads of 64 (the deck's table and the preset: 48 of 128, the same parameters); its DeepSpeed "
          "config says train_micro_batch_size_per_gpu 4 where Megatron's --micro-batch-size is 2; the fork's "
          "megatron/arguments.py defines no --model-size and parses with parse_args(), which exits on an "
          "unrecognized argument")

# PART_II's `ds_config_4N_22B.json`, the config `launch_gpt22b_srun.frontier` passes, key for key (the whole file).
# It sets no train_batch_size, gradient_accumulation_steps or gradient_clipping. Its optimizer block's "auto"
# values are a Hugging Face Trainer convention that DeepSpeed does not fill in; the fork's training.py hands
# Megatron's own optimizer to deepspeed.initialize, which then uses that one and not this block.
PART_II_22B_DS_CONFIG = {
    "fp16": {"enabled": True},
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "Adam", "params": {"torch_adam": False, "adam_w_mode": False, "lr": "auto",
                                             "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 1},
}

# PART_II's two other Megatron scripts beside the 22B one (the same files on FORK_SD), read flag for flag. Neither
# passes --deepspeed (nor a DeepSpeed config, --checkpoint-activations or --use-flash-attn-v2): Megatron's own
# training loop and optimizer, with the asynchronous TP all-reduce on. Both ramp the batch up with
# `--rampup-batch-size 2 2 1000` (from 2 sequences, 2 more at a time, over 1000 samples) to the global batch.
PART_II_SRUN = {
    "175b": Script("launch_gpt175b_srun.frontier", PART_II, "(no deck names it)", "175b", nodes=24, tp=8, pp=12,
                   heads=96, seq_len=2048, micro_batch=1, global_batch=12, zero=0, precision="fp16", ds_config=None,
                   ds_precision=None, flash_attention=None, checkpoint_activations=False, deepspeed=False,
                   entry="pretrain_gpt_owt3.py", entry_in_repository=False,
                   notes="runs `python pretrain_gpt_owt3.py`, a file neither repository holds (PART_II at e6452a3, "
                         "FORK_SD at 531936f); its log names say 24N"),
    "1t": Script("launch_gpt1T_srun.frontier", PART_II, "(no deck names it)", "1t", nodes=64, tp=8, pp=64, heads=128,
                 seq_len=2048, micro_batch=1, global_batch=8, zero=0, precision="fp16", ds_config=None,
                 ds_precision=None, flash_attention=None, checkpoint_activations=False, deepspeed=False,
                 entry="pretrain_gpt.py", notes="one pipeline of the whole 512 GCDs (TP 8 x PP 64), 8 micro-batches"),
}



@dataclass(frozen=True)
class Launch(_MaxConnections):
    """A launch of the workshop's Megatron-DeepSpeed that no deck's table describes and the planner is not compared
    with: only what decides what CUDA_DEVICE_MAX_CONNECTIONS does, read from the file; the rest in `notes`."""

    path: str
    source: str
    tp: int | tuple[int, ...]    # --tensor-model-parallel-size; a search's sampled sizes as a tuple
    deepspeed: bool
    notes: str
    entry: str = "pretrain_gpt_deepspeed.py"
    entry_in_repository: bool = True
    exports_max_connections: bool = True


OTHER_LAUNCHES = (
    Launch("launch_gpt_srun.frontier", PART_II, tp=8, deepspeed=True,
           notes="`#SBATCH -N 4`, TP 8 x PP 2, 24 layers of hidden size 2064 with 24 heads, micro-batch 2 (no "
                 "--global-batch-size); `--deepspeed --zero-stage 0 --deepspeed_config ds_config.json` (a config that "
                 "enables fp16 and sets no ZeRO stage), `--deepspeed-activation-checkpointing "
                 "--checkpoint-activations`; no Megatron precision flag (its `--fp16` is commented out). The same file "
                 "on FORK_SD."),
    Launch("launch_gpt_srun.frontier", FORK, tp=1, deepspeed=True,
           notes="`#SBATCH -N 1`, TP 1 x PP 1, 24 layers of hidden size 2112 with 24 heads, micro-batch 1, global batch "
                 "160, `--fp16 --deepspeed --deepspeed_config ds_config.json` (a file FORK at 03325d4 does not hold), "
                 "`--checkpoint-activations`, `--use-flash-attn-v2`. Another file than PART_II's of the same name."),
    Launch("launch_dh.frontier", FORK_SD, tp=(1, 2, 4, 8), deepspeed=True,
           notes="exports the variable and runs `python main_dh_centralized.py`, which starts each sample with "
                 "`subprocess` (so with this environment) as the srun command `dh_utils.py` writes: "
                 "`pretrain_gpt_deepspeed.py ... --fp16 ... --deepspeed --deepspeed_config ds_config_<job>.json "
                 "--deepspeed-activation-checkpointing --checkpoint-activations`, TP and PP sampled from 1, 2, 4, 8 "
                 "(DEEPHYPER_HANDS_ON)."),
)

# Every Megatron launch script of the workshop, for what each does with CUDA_DEVICE_MAX_CONNECTIONS: the `launch_*`
# files at the root of FORK and FORK_SD and in PART_II's directory (nine files: FORK_SD's three srun scripts are
# PART_II's), the DeepHyper search's samples counted with `launch_dh.frontier`.
SCRIPTS = (*HANDS_ON.values(), PART_II_22B, *PART_II_SRUN.values(), *OTHER_LAUNCHES)

# Where the fork reads CUDA_DEVICE_MAX_CONNECTIONS: `validate_args` in megatron/arguments.py, the same lines at FORK
# (03325d4, there inside `if not args.use_dataset_only:`), FORK_SD (531936f) and PART_II (e6452a3):
#     if args.sequence_parallel: args.async_tensor_model_parallel_allreduce = False
#     # TODO: currently DeepSpeed seems to be incompatible with async_tensor_model_parallel_allreduce ...
#     if args.deepspeed: args.async_tensor_model_parallel_allreduce = False
#     if os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1":
#         raise RuntimeError if args.sequence_parallel, or if args.async_tensor_model_parallel_allreduce
# The flag is on unless `--no-async-tensor-model-parallel-allreduce` is given; ColumnParallelLinear uses it only with
# more than one TP rank (megatron/core/tensor_parallel/layers.py, "Here we rely on CUDA_DEVICE_MAX_CONNECTIONS=1 to
# ensure that the all-reduce is scheduled before the weight gradient computation").
MAX_CONNECTIONS_CHECK = "megatron/arguments.py, validate_args"
# On ROCm the HIP runtime takes the number of hardware queues per device from its own variable, GPU_MAX_HW_QUEUES
# (ROCm's HIP runtime, clr); none of the scripts above sets it. Whether HIP reads CUDA_DEVICE_MAX_CONNECTIONS too is
# not checked here.
ROCM_HW_QUEUES = "GPU_MAX_HW_QUEUES"

# DASH_2023, the abstract: "For 22 Billion, 175 Billion, and 1 Trillion parameters, we achieved GPU throughputs of
# 38.38%, 36.14%, and 31.96%, respectively" (Fig. 11, "MI250X Throughput for various model sizes. We report the
# hardware FLOPS, which are in close agreement with the model FLOPS"): fractions of a GCD's 16-bit peak, 191.5
# TFLOP/s, so 73.5, 69.2 and 61.2 TFLOP/s per GCD. Hardware FLOPs count the recomputation: the TFLOPs the fork
# logs (megatron/utils.py, `throughput_calculator`, the same at FORK, FORK_SD and PART_II) follow "Equation 3 in
# Section 5.1" of Narayanan et al. 2021, 24 x factor x B s l h^2 (1 + s/6h + V/16lh) per step, where "The factor of 4
# is when used with activation check-pointing, otherwise it will be 3" (4 also under --recompute-granularity
# selective). The planner's `tflops_per_gpu` counts full recomputation the same way (its selective only the attention
# core again), so Table VI's runs, with checkpoint-activations, compare with the planner's full recomputation. The
# abstract does not say on which layout and GPU count each was measured.
MEASURED_PEAK_FRACTION = {"22b": 0.3838, "175b": 0.3614, "1t": 0.3196}

# "For 22B, 175B, and 1T parameter model, the estimated energy consumption is 284 Gigajoules, 17.65
# Terajoules, and 662 Terajoules", from "iteration time, consumed tokens per iterations, average active
# power, and total number of MI250X GPU cards" (the token count assumed is not printed); "Idle GPU power
# is approximately 90 Watts".
DECK_TRAINING_ENERGY_J = {"22b": 284e9, "175b": 17.65e12, "1t": 662e12}
NOMINAL_PARAMS = {"22b": 22e9, "175b": 175e9, "1t": 1e12}      # the deck's names for the models
DECK_IDLE_GCD_WATTS = 90.0
