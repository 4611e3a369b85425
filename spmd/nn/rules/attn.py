"""Attention over a split sequence: ``F.scaled_dot_product_attention`` as
``spmd.ops.ring_attention``, ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``)
as ``spmd.nn.MultiheadAttention``'s sharded forward; masks, weights and dropout that
cannot be exact on shards are refused."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import ops
from .._tags import axes_str
from ..attention import sharded_mha_forward
from ._base import Call, PerOutput, _arg, _where, broadcast_shapes
from .windows import _signature


def attention(c: Call) -> Any:
    """F.scaled_dot_product_attention: over a split sequence (dim -2 of q, k, v), as
    ``spmd.ops.ring_attention``; split batch or head dims pass."""
    q, k, v = c.args[0], c.args[1], c.args[2]
    mask = _arg(c, "attn_mask", 3, None)
    dropout_p = _arg(c, "dropout_p", 4, 0.0)
    causal = bool(_arg(c, "is_causal", 5, False))
    scale, gqa = _arg(c, "scale", 6, None), bool(_arg(c, "enable_gqa", 7, False))
    for t in (q, k, v):
        e = c.ent(t)
        if t.ndim and e[-1]:
            c.refuse(f"contracts the features, and {_where(t.ndim - 1, e[-1])}",
                     "keep the feature dim whole (split the sequence, batch or heads)")
    sq, sk, sv = (c.ent(t)[-2] if t.ndim >= 2 else None for t in (q, k, v))
    lead = broadcast_shapes(c, [(c.ent(t)[:-2], tuple(t.shape[:-2])) for t in (q, k, v)])
    if sk != sv:
        c.refuse("gets keys and values split differently along the sequence",
                 "split k and v alike")
    if sk and not sq:
        c.refuse(f"attends to keys split along {_where(k.ndim - 2, sk)} from whole queries",
                 "split the queries' sequence over the same axes")
    if sq and sk and sq != sk:
        c.refuse(f"gets queries split over {axes_str(sq)} and keys over {axes_str(sk)}",
                 "split both sequences over the same axes")
    if sq and dropout_p:
        c.refuse(f"drops attention weights at random (dropout_p={dropout_p}) over a split "
                 f"sequence, which cannot match one device", "pass dropout_p=0 (in eval)")
    if mask is not None:
        _attention_mask(c, mask, sq, q)
    out = tuple(lead) + (sq, None)
    if not sq:
        return c.out(c.call(), out)
    if not sk:
        if causal:
            c.refuse("is causal with whole keys and split queries (it needs each rank's row "
                     "offset)", "split the keys like the queries")
        return c.out(c.call(), out)  # each rank's rows against all keys: exact as it is
    c.record("swapped", f"sequence split over {axes_str(sq)} -> spmd.ops.ring_attention")
    if c.planning:
        return c.out(c.call(), out)

    def twin(*_, **__):
        return ops.ring_attention(q, k, v, c.mesh, sq, seq_dim=-2, causal=causal,
                                  attn_mask=mask, scale=scale, enable_gqa=gqa)
    return c.out(c.call(twin), out)


def _attention_mask(c: Call, mask: torch.Tensor, rows: Any, q: torch.Tensor) -> None:
    """A mask fits a split sequence when it holds this rank's query rows (dim -2 split
    like the queries, or of size 1) and all key columns (dim -1 whole)."""
    e = c.ent(mask)
    if mask.ndim and e[-1]:
        c.refuse(f"gets a mask whose key dim is split ({_where(mask.ndim - 1, e[-1])})",
                 "keep the mask's key columns whole (the global key length)")
    if mask.ndim >= 2 and e[-2] != rows and not (e[-2] is None and mask.shape[-2] == 1):
        c.refuse("gets a mask whose query rows are not split like the queries",
                 "split the mask's dim -2 like the queries' sequence (this rank's rows, all "
                 "key columns), or give it one row")
    broadcast_shapes(c, [(e[:-2], tuple(mask.shape[:-2])), (c.ent(q)[:-2], tuple(q.shape[:-2]))])


def multi_head_attention(c: Call) -> Any:
    """F.multi_head_attention_forward (nn.MultiheadAttention's forward, sequence first):
    over a split sequence, ``spmd.nn.MultiheadAttention``'s sharded forward."""
    a = _signature(F.multi_head_attention_forward).bind(*c.args, **c.kwargs)
    a.apply_defaults()
    a = a.arguments
    query, key, value = a["query"], a["key"], a["value"]
    for t in (query, key, value):
        e = c.ent(t)
        if e[-1]:
            c.refuse(f"projects the features, and {_where(t.ndim - 1, e[-1])}",
                     "keep the feature dim whole")
    eq, ek, ev = c.ent(query), c.ent(key), c.ent(value)
    batched = query.ndim == 3
    sq, sk = eq[0], ek[0]
    eb = eq[1] if batched else None
    if ev[0] != sk or (batched and not (ek[1] == ev[1] == eb)):
        c.refuse("gets query, key and value split differently",
                 "split key and value like each other, and their batch like the query's")
    kpm, mask = a["key_padding_mask"], a["attn_mask"]
    if kpm is not None and kpm.ndim == 2 and c.ent(kpm)[0] != eb:
        c.refuse("gets a key padding mask whose batch is not split like the query's",
                 _KPM_FIX)
    if mask is not None and mask.ndim == 3 and c.ent(mask)[0] != eb:
        c.refuse("gets a 3-d attn_mask whose N * num_heads dim is not split like the batch")
    out = (sq, eb, None) if batched else (sq, None)
    if not sq and not sk:  # only the batch is split: torch's, sample by sample
        if mask is not None and any(c.ent(mask)[-2:]) or kpm is not None and c.ent(kpm)[-1]:
            c.refuse("gets a mask split along the sequence while the sequence is whole")
        weights = PerOutput(lambda w: (eb,) + (None,) * (w.ndim - 1) if batched else None)
        return c.out(c.call(), [out, weights])
    if not sq:
        c.refuse(f"attends to keys split along {_where(0, sk)} from whole queries",
                 "split the queries' sequence over the same axes")
    if sk and sk != sq:
        c.refuse(f"gets queries split over {axes_str(sq)} and keys over {axes_str(sk)}",
                 "split both sequences over the same axes")
    if a["need_weights"]:
        c.refuse("returns the attention weights (need_weights=True, nn.MultiheadAttention's "
                 "default): over a split sequence they are the whole L x S matrix",
                 "call the layer with need_weights=False")
    if a["dropout_p"] and a["training"]:
        c.refuse(f"drops attention weights at random (dropout={a['dropout_p']}) in training "
                 f"over a split sequence, which cannot match one device",
                 "use dropout=0, or eval mode")
    if a["static_k"] is not None or a["static_v"] is not None:
        c.refuse("gets static_k/static_v over a split sequence")
    kpm_split = False
    if kpm is not None:
        ke = c.ent(kpm)[-1]
        if ke and ke != sk:
            c.refuse("gets a key padding mask split otherwise than the keys", _KPM_FIX)
        kpm_split = bool(ke)
    dropped = a["is_causal"] and kpm is None  # torch's hint: the mask is not used
    if mask is not None and not dropped:
        me = c.ent(mask)
        if me[-1]:
            c.refuse(f"gets an attn_mask whose key dim is split ({_where(mask.ndim - 1, me[-1])})",
                     "keep its key columns whole (the global key length)")
        if me[-2] != sq:
            c.refuse("gets an attn_mask whose query rows are not split like the queries",
                     "split the mask's dim -2 like the query's sequence (this rank's rows, all "
                     "key columns)")
    if a["is_causal"] and not sk:
        c.refuse("is causal with whole keys and split queries (it needs each rank's row "
                 "offset)", "split the keys like the queries")
    c.record("swapped", f"sequence split over {axes_str(sq)} -> spmd.nn.MultiheadAttention's "
                        f"forward (spmd.ops.ring_attention)")
    if c.planning:
        return c.out(c.call(), [out, None])

    def twin(*args, **kwargs):
        return sharded_mha_forward(*args, **kwargs, mesh=c.mesh, axes=sq, kv_split=bool(sk),
                                   key_padding_mask_split=kpm_split, strategy="ring")
    return c.out(c.call(twin), [out, None])


_KPM_FIX = ("a (batch, keys) mask is split along dim 1 like the keys: give convert a spec "
            "per input by the forward's parameter names, e.g. {'x': P('sp'), "
            "'key_padding_mask': P(None, 'sp')}")
