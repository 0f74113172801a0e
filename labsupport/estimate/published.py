"""Published large-scale training layouts and what they measured, to hold the planner against.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Table 1: GPT models trained with Megatron-LM on DGX A100 (80 GB) nodes, sequence
length 2048, vocabulary 51,200. Each row: parameters (billions), attention heads, hidden size,
layers, tensor-parallel size, pipeline-parallel size, GPUs, global batch size, and the achieved
TFLOP/s per GPU (recomputation included). The micro-batch size is not in the table.

`RUNS`: measured runs on three generations of accelerators (A100, H100, MI250X), each with its source,
shape, layout and throughput in its source's own FLOP convention (`Run`), for the planner's validation
table (issue 31, in progress).
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from .machines import DGX_A100, DGX_H100, FRONTIER, JEAN_ZAY_A100, Machine
from .shapes import PRESETS, ModelConfig
from .step_time import Framework
from .workshop import MEASURED_PEAK_FRACTION, STRONG_SCALING, TABLE_VI

SEQ_LEN, VOCAB = 2048, 51200


class Row(NamedTuple):
    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float

    def shape(self) -> ModelConfig:
        """The row's model as a ModelConfig."""
        return ModelConfig(f"{self.billions}B", self.layers, self.hidden, self.heads, VOCAB, SEQ_LEN)


NARAYANAN_TABLE_1 = [Row(*r) for r in (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)]


class Run(NamedTuple):
    """One published training run: its shape, where it ran, its layout, and the throughput it measured.

    `counts` says which FLOPs the published TFLOP/s per GPU count: "hardware", what the GPUs executed,
    recomputation included (Narayanan et al. 2021, Sec. 5.1, eq. 3, as Megatron-LM and BigScience log
    it; `planner.step_flops(cfg, batch, recompute)`), or "model", the model's alone (Chowdhery et al.
    2022, App. B, MFU; `planner.step_flops(cfg, batch, "none")`). Both count every score of the s x s
    attention matrix, masked half included, as Narayanan et al.'s eq. 3, Korthikanti et al.'s App. A and
    Megatron-Core's code do; Llama 3's paper does not say whether its MFU does. `step_s` is the printed iteration time where the source
    gives one. `notes` say what the source leaves out and what is taken for it.
    """

    name: str
    source: str
    cfg: ModelConfig
    machine: Machine      # the device, and the cluster's links
    global_batch: int     # sequences per step
    dp: int
    tp: int
    pp: int
    cp: int
    micro_batch: int
    virtual: int          # model chunks per pipeline stage (the interleaved schedule)
    zero: int             # 1: optimizer states sharded over the data-parallel ranks
    recompute: str
    framework: Framework  # the kernels and overlaps the training code used
    tflops_per_gpu: float
    counts: str
    step_s: float | None = None
    notes: str = ""

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


def _gpt(name, layers, hidden, heads, vocab=VOCAB, seq_len=SEQ_LEN) -> ModelConfig:
    return ModelConfig(name, layers, hidden, heads, vocab, seq_len)


_KORTHIKANTI = "Korthikanti et al. 2022, \"Reducing Activation Recomputation in Large Transformer Models\""
_MEGATRON_CORE = "Megatron-LM README and images/model_table.png (commit f2e5db402c, Megatron-Core r0.8.0)"
_LLAMA3 = "Dubey et al. 2024, \"The Llama 3 Herd of Models\", Table 4"
_SELENE = DGX_A100   # Selene: DGX A100 nodes, one 200 Gb/s HDR InfiniBand card per GPU
_MEGATRON_2022 = Framework(sequence_parallel=True)   # unfused attention; the gradient all-reduce not overlapped

# Korthikanti et al. 2022: Table 3 (layouts, no data parallelism, micro-batch 4 for 22B and 1 else, three
# interleaved stages for 175B and 530B), Table 5 ("present work": sequence parallelism + selective
# recomputation; iteration time and MFU over 312 TFLOP/s), and Sec. 6.3's 530B on 2,240 GPUs (DP 8,
# batch x 8, 39.15 s, MFU 54.2 %, no overlap of the gradient all-reduce). Sequence 2048, vocabulary 51,200.
_K_NOTES = "mixed precision (fp16 or bf16 not stated); Megatron-LM's unfused attention (2022)"
KORTHIKANTI_TABLE_5 = [
    Run("22B, selective + SP", f"{_KORTHIKANTI}, Table 5, row 22B", _gpt("22B", 48, 6144, 64), _SELENE,
        4, 1, 8, 1, 1, 4, 1, 0, "selective", _MEGATRON_2022, 0.415 * 312, "model", 1.10, _K_NOTES),
    Run("175B, selective + SP", f"{_KORTHIKANTI}, Table 5, row 175B", _gpt("175B", 96, 12288, 96), _SELENE,
        64, 1, 8, 8, 1, 1, 3, 0, "selective", _MEGATRON_2022, 0.514 * 312, "model", 13.75, _K_NOTES),
    Run("530B, selective + SP", f"{_KORTHIKANTI}, Table 5, row 530B", _gpt("530B", 105, 20480, 128), _SELENE,
        280, 1, 8, 35, 1, 1, 3, 0, "selective", _MEGATRON_2022, 0.560 * 312, "model", 37.83, _K_NOTES),
    Run("1T, selective + SP", f"{_KORTHIKANTI}, Table 5, row 1T", _gpt("1T", 128, 25600, 160), _SELENE,
        512, 1, 8, 64, 1, 1, 1, 0, "selective", _MEGATRON_2022, 0.563 * 312, "model", 71.49,
        _K_NOTES + "; interleaving not stated for 1T, taken as none"),
    Run("530B on 2,240 GPUs", f"{_KORTHIKANTI}, Sec. 6.3", _gpt("530B", 105, 20480, 128), _SELENE,
        2240, 8, 8, 35, 1, 1, 3, 0, "selective", _MEGATRON_2022, 0.542 * 312, "model", 39.15, _K_NOTES),
]

# BigScience BLOOM-176B (bigscience-workshop/bigscience, train/tr11-176B-ml/README.md and
# tr11-176B-ml.slurm): 384 A100 80GB on Jean Zay, TP 4 x PP 12 x DP 8, micro-batch 2, global batch 2048,
# full recomputation, bf16, DeepSpeed's BF16_Optimizer sharding the optimizer states (its own ZeRO-1); the
# log line at iteration 85,376: 104.70 s per iteration, "TFLOPs: 149.77" (eq. 3 with recomputation).
BLOOM = Run("BLOOM-176B", "BigScience tr11-176B-ml README, \"Important checkpoints\", iteration 85376",
            _gpt("BLOOM-176B", 70, 14336, 112, vocab=250880), JEAN_ZAY_A100,
            2048, 8, 4, 12, 1, 2, 1, 1, "full", Framework(), 149.77, "hardware", 104.70,
            "ALiBi and an embedding LayerNorm, which the GPT shape here leaves out; 70 layers on 12 stages: "
            "the embedding and head stages hold 5, the others 6")

# Megatron-Turing NLG 530B (Smith et al. 2022, Sec. 2.4, as quoted by three independent secondary sources;
# the layout, TP 8 x PP 35 per replica, in Sec. 2.2 and Korthikanti et al. Sec. 5): batch 1920 on 280, 350 and
# 420 DGX A100 (DP 8, 10, 12), 60.1, 50.2 and 44.4 s, 126, 121 and 113 TFLOP/s per GPU (eq. 3 with full
# recomputation reproduces them).
_MTNLG_NOTES = "micro-batch and ZeRO stage not in the quotations (taken as 1 and ZeRO-1); DeepSpeed's 1F1B pipeline"
MT_NLG = [
    Run(f"MT-NLG 530B, DP {dp}", f"Smith et al. 2022, Sec. 2.4 ({servers} servers)", _gpt("530B", 105, 20480, 128),
        _SELENE, 1920, dp, 8, 35, 1, 1, 1, 1, "full", Framework(), tflops, "hardware", step, _MTNLG_NOTES)
    for dp, servers, step, tflops in ((8, 280, 60.1, 126), (10, 350, 50.2, 121), (12, 420, 44.4, 113))
]

# Megatron-Core r0.8.0 weak scaling on H100 (the README's table as an image): GPT models at sequence 4096 and
# vocabulary 131,072, DP 48, batch and TFLOP/s per GPU as printed; MFU = TFLOP/s / 989 (model FLOPs, the
# code's num_floating_point_operations). DP, TP and PP communication overlapped (the README's flags).
_MC_NOTES = ("micro-batch, interleaving and recomputation not printed (taken as 1, none, none); "
             "bf16, sequence parallelism and Transformer Engine's fused attention assumed")
MEGATRON_CORE_H100 = [
    Run(f"Megatron-Core {name}", f"{_MEGATRON_CORE}, row {name}", _gpt(name, layers, hidden, heads, 131072, 4096),
        DGX_H100, batch, 48, tp, pp, 1, 1, 1, 1, "none", Framework(True, True, True, True), tflops, "model",
        None, _MC_NOTES)
    for name, heads, hidden, layers, tp, pp, batch, tflops in (
        ("70B", 64, 8192, 84, 8, 2, 384, 419.7), ("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
        ("462B", 144, 18432, 112, 8, 16, 3072, 459.9))
]

# Llama 3 405B pre-training (Table 4; layout and kernels in Sec. 3.3.2; the network in Sec. 3.3.1, 8 GPUs on
# NVLink per server and 400 Gb/s RoCE per GPU, as a DGX H100's): TP 8, CP, PP 16, FSDP over DP that
# shards gradients and optimizer states (ZeRO-2-like: the same traffic as ZeRO-1 here), interleaved pipeline,
# no activation recomputation at 8k tokens, bf16, MFU over 989 TFLOP/s. The 128k row prints DP 4 in arXiv v1, which makes
# 8,192 GPUs and 8M tokens a batch, not its 16,384 GPUs and 16M: DP 8 makes both hold.
_LLAMA_NOTES = ("micro-batch, virtual stages and sequence parallelism not stated (taken as 1, 1, on); "
                "Table 3's vocabulary is 128,000, the released model's 128,256 is used")
LLAMA3_405B = [
    Run(f"Llama 3 405B, {gpus:,} GPUs, {seq // 1024}k", f"{_LLAMA3}, row {row}",
        replace(PRESETS["llama3-405b"], seq_len=seq), DGX_H100, dp * per_dp, dp, 8, 16, cp, 1, 1, 1, "none",
        Framework(flash_attention=True, sequence_parallel=True, overlap_dp=True), tflops, "model", None,
        _LLAMA_NOTES + ("; DP 8 where arXiv v1's table prints 4, recomputation at 128k not stated" if cp > 1 else ""))
    for row, gpus, seq, dp, cp, per_dp, tflops in ((1, 8192, 8192, 64, 1, 32, 430), (2, 16384, 8192, 128, 1, 16, 400),
                                                   (3, 16384, 131072, 8, 16, 16, 380))
]

# The workshop's runs on Frontier (Dash et al. 2023, the Part III deck): the abstract's throughput per GCD
# as a fraction of 191.5 TFLOP/s, hardware FLOPs (Fig. 11's caption), fp16, FlashAttention-2, ZeRO-1, full
# recomputation (Table VI). The paper does not say on which layout and GCD count each fraction was measured:
# taken as Table VI's layouts at the strong-scaling runs' GCD counts and batches (Fig. 13), as notebook 06 does.
DASH_FRONTIER = [
    Run(f"Frontier {model}", f"Dash et al. 2023, abstract; Table VI; Fig. 13 ({model})", PRESETS[model],
        FRONTIER, STRONG_SCALING[model].global_batch,
        STRONG_SCALING[model].gpus // (TABLE_VI[model].tp * TABLE_VI[model].pp), TABLE_VI[model].tp,
        TABLE_VI[model].pp, 1, TABLE_VI[model].micro_batch, 1, TABLE_VI[model].zero, "full", Framework(flash_attention=True),
        MEASURED_PEAK_FRACTION[model] * 191.5, "hardware", None,
        "the layout and GCD count of each measured fraction are not printed (see above)")
    for model in ("175b", "1t")
]


# Narayanan et al. 2021's Table 1 as runs: the micro-batch and interleaving of each row are those of the
# paper's launch script (NVIDIA/Megatron-LM examples/sc21/run_table_1.sh and CONFIG.sh, commit de7dc40f88,
# "scripts for sc21"): full recomputation, fp16, no distributed optimizer; PyTorch's DDP, which overlaps its
# bucketed all-reduce with the backward, up to 18B, Megatron's "local" DDP, which does not, from 39B.
_SC21 = {1.7: (16, 1), 3.6: (16, 1), 7.5: (16, 1), 18.4: (8, 1), 39.1: (4, 1), 76.1: (2, 3), 145.6: (2, 2),
         310.1: (1, 2), 529.6: (1, 3), 1008.0: (1, 1)}   # billions: (micro-batch, virtual stages)
NARAYANAN_RUNS = [
    Run(f"Narayanan {r.billions}B", f"Narayanan et al. 2021, Table 1, row {r.billions}B; sc21 scripts", r.shape(),
        _SELENE, r.batch, r.gpus // (r.tp * r.pp), r.tp, r.pp, 1, _SC21[r.billions][0], _SC21[r.billions][1], 0,
        "full", Framework(overlap_dp=r.billions < 20), r.tflops_per_gpu, "hardware")
    for r in NARAYANAN_TABLE_1
]

RUNS = [*NARAYANAN_RUNS, *KORTHIKANTI_TABLE_5, BLOOM, *MT_NLG, *MEGATRON_CORE_H100, *LLAMA3_405B, *DASH_FRONTIER]
