"""What a mixture-of-experts layer holds and what expert parallelism sends, from the layer's shape.

Parameters: a MoE layer holds n_experts MLPs and a router, but each token runs only top_k of
them: the model's total parameters grow with the experts, its active ones (the FLOPs per token)
with top_k (Fedus et al. 2021, "Switch Transformers", Sec. 2; Jiang et al. 2024, "Mixtral of
Experts": 47B parameters, 13B active; 46.7B and 12.9B in Mistral AI's release).

Traffic (labsupport.parallel.experts): GShard (Lepikhin et al. 2021, Sec. 3.2) runs a MoE layer
over ep ranks with two all-to-alls in forward, dispatch (each token's row to the ranks of its
experts) and combine (the experts' outputs back), and their two mirror images in backward. A
row travels once per kept assignment, top_k per token less the dropped ones, in each of the
four. Ours also all-gathers each rank's assignment counts per (choice, expert) in forward,
top_k x n_experts int64 per rank, from which every rank knows what to send, receive and drop
(Megatron-LM's all-to-all dispatcher exchanges its counts per expert the same way).

Sizes are summed over the ep ranks, in the units labsupport.comm counts: `payload_bytes` is what
a rank's calls send (an all-to-all's whole input, its own block included; an all-gather's
gathered buffer), `wire_bytes` that times nccl-tests' bus factor. How the all-to-all payload
splits between the ranks depends on the routing (what a rank's tokens send plus what its
experts return); balanced, each rank sends 1/ep of it.
"""
from __future__ import annotations

from .comm_cost import BUS_FACTOR

COUNT_BYTES = 8  # the routing counts are int64


def expert_params(hidden: int, ffn: int, *, gated: bool = False, bias: bool = True) -> int:
    """One expert's parameters. TinyGPT's expert is its MLP, hidden x ffn in and ffn x hidden out
    (biases ffn + hidden); Mixtral's is a SwiGLU (Jiang et al. 2024, Sec. 2.1; Shazeer 2020), three
    bias-free matrices: two in (the gate and the value), one out."""
    inputs = 2 if gated else 1
    return (inputs + 1) * hidden * ffn + ((inputs * ffn + hidden) if bias else 0)


def moe_layer_params(hidden: int, ffn: int, n_experts: int, top_k: int, *, gated: bool = False,
                     bias: bool = True) -> dict:
    """{"total", "active", "router"}: the parameters of one MoE layer (the bias-free router, hidden x
    n_experts, and the experts) and those one token uses, the router and top_k experts (Fedus et al.
    2021, Sec. 2.1; Jiang et al. 2024, Sec. 2)."""
    router = hidden * n_experts
    one = expert_params(hidden, ffn, gated=gated, bias=bias)
    return {"total": router + n_experts * one, "active": router + top_k * one, "router": router}


# Mixtral 8x7B's shape: Jiang et al. 2024, "Mixtral of Experts", Table 1 (dim 4096, n_layers 32, head_dim
# 128, hidden_dim 14336, n_heads 32, n_kv_heads 8, vocab_size 32000, num_experts 8, top_k_experts 2).
MIXTRAL_8X7B = dict(n_layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32000,
                    n_experts=8, top_k=2)


def moe_model_params(n_layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, vocab: int,
                     n_experts: int, top_k: int) -> dict:
    """{"total", "active"}: the parameters of a decoder built as Mixtral is, and those one token uses.

    Jiang et al. 2024, Sec. 2: Mistral 7B's architecture with every MLP a mixture of SwiGLU experts.
    Per layer: grouped-query attention without biases (the query and output projections hidden x
    heads head_dim, the key and value projections hidden x kv_heads head_dim), two RMSNorm weights,
    and the MoE layer (`moe_layer_params`, gated, bias-free); around the layers an untied embedding
    and LM head (vocab x hidden each) and a final RMSNorm. A token uses the router and top_k experts
    of each layer and everything else. Mixtral 8x7B: 46.7B and 12.9B (Mistral AI's release; the
    paper rounds them to 47B and 13B). The count is `params.count_params` and `params.active_params`
    of that shape (the `mixtral-8x7b` preset), so there is one formula; heads x head_dim must be hidden."""
    from .params import active_params, count_params  # params imports this module
    from .shapes import LLAMA, ModelConfig
    if heads * head_dim != hidden:
        raise ValueError(f"heads x head_dim ({heads} x {head_dim}) must be hidden ({hidden})")
    cfg = ModelConfig("moe", n_layers, hidden, heads, vocab, 1, **LLAMA, ffn_hidden=ffn, kv_heads=kv_heads,
                      experts=n_experts, top_k=top_k)
    return {"total": count_params(cfg), "active": active_params(cfg)}


def moe_comm(tokens: int, hidden: int, top_k: int, n_experts: int, ep: int, *, dropped: int = 0,
             bytes_per_element: int = 4) -> dict:
    """{"forward": {op: {"calls", "payload_bytes", "wire_bytes"}}, "backward": ...}: one MoE layer's
    communication for `tokens` tokens (all ep ranks' together), summed over the ep ranks; `dropped`
    assignments travel nowhere. GShard, Sec. 3.2: dispatch and combine in forward, their gradients
    in backward, each moving every kept assignment's row of `hidden` elements once. The expert's own
    shape does not enter: a GELU MLP and a SwiGLU expert (Mixtral's, three matrices of any ffn) take and
    give rows of `hidden` alike; only its parameters (`expert_params`) and FLOPs differ."""
    if ep == 1:
        return {"forward": {}, "backward": {}}
    rows = (tokens * top_k - dropped) * hidden * bytes_per_element

    def op(name, calls, payload):
        return {name: {"calls": calls, "payload_bytes": payload, "wire_bytes": round(BUS_FACTOR[name](ep) * payload)}}

    all_to_all = op("all_to_all", 2 * ep, 2 * rows)
    counts = op("all_gather", ep, ep * ep * top_k * n_experts * COUNT_BYTES)  # each rank gathers every rank's
    return {"forward": {**all_to_all, **counts}, "backward": all_to_all}
