"""The pieces ring attention is built from, as notebook 07's ring cells use them: one block's
attention under a mask (`attend`), the online-softmax merge of two partial results (`merge`), and the
hop of a K/V block to the next rank of the ring, with its backward (`pass_on`).

They live apart from the notebook's lab module so that a cell can import them without pointing at the
module that holds the exercises' solutions.
"""
from __future__ import annotations

import functools
import math


def attend(q, k, v, visible=None):
    """One block's attention: (output, log-sum-exp of each query row's scores), under the boolean
    mask `visible` (query rows x key columns, True = may attend; None = all). A row that sees no key
    gets output 0 and log-sum-exp -inf: it contributes nothing when merged."""
    import torch
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # a row with no key: exp(-inf - -inf) is nan
    return p @ v, lse


def merge(out1, lse1, out2, lse2):
    """The online-softmax merge of two partial results over disjoint sets of keys."""
    import torch
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).nan_to_num(0.0)[..., None]  # both -inf (no key yet): weight 0
    w2 = torch.exp(lse2 - lse).nan_to_num(0.0)[..., None]
    return out1 * w1 + out2 * w2, lse


@functools.cache
def _pass_on_function():
    """The hop as an autograd function: K/V to the next rank in forward; in backward each block's
    gradient goes back to the rank it came from, so every rank's contribution reaches the owner."""
    import torch

    from .. import comm
    from ..parallel.context import start_pass_on

    class PassOn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, k, v):
            return tuple(start_pass_on([k.contiguous(), v.contiguous()], None)())

        @staticmethod
        def backward(ctx, dk, dv):
            me, n = comm.get_rank(), comm.get_world_size()
            dk, dv = dk.contiguous(), dv.contiguous()
            back = [torch.empty_like(dk), torch.empty_like(dv)]
            works = comm.batch_isend_irecv([("send", dk, (me - 1) % n, 0),
                                            ("send", dv, (me - 1) % n, 1),
                                            ("recv", back[0], (me + 1) % n, 0), ("recv", back[1], (me + 1) % n, 1)])
            for work in works:
                work.wait()
            return tuple(back)
    return PassOn


def pass_on(k, v):
    """Send this rank's K/V block to the next rank of the ring; return the previous rank's."""
    return _pass_on_function().apply(k, v)
