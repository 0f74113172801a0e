"""Published large-scale training layouts, to hold the planner against.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Table 1: GPT models trained with Megatron-LM on DGX A100 (80 GB) nodes, sequence
length 2048, vocabulary 51,200. Each row: parameters (billions), attention heads, hidden size,
layers, tensor-parallel size, pipeline-parallel size, GPUs, global batch size, and the achieved
TFLOP/s per GPU (recomputation included). The micro-batch size is not in the table.
"""
from __future__ import annotations

from typing import NamedTuple

from .shapes import ModelConfig

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
