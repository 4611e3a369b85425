"""``spmd.nn.MultiheadAttention``: ``nn.MultiheadAttention`` over a sequence split across
ranks, and the sharded ``multi_head_attention_forward`` that ``spmd.nn.convert`` swaps in.

torch's multi-head attention is a per-position input projection, SDPA over the
sequence, and a per-position output projection. On shards the projections run as they
are; SDPA runs as ``spmd.ops.ring_attention`` (K/V blocks around the ring: any number of
heads) or ``spmd.ops.head_parallel_attention`` (all_to_alls that give each rank whole
sequences of some heads), chosen by ``strategy``. Everything else follows torch's
``F.multi_head_attention_forward`` step by step, so the result is torch's:

- masks: bool masks become additive (-inf where True), as torch does; the key padding
  mask, split along the keys like them, is gathered (N x S elements: small) and added;
- ``is_causal`` is torch's hint: without a key padding mask the attention mask is
  dropped and the kernels apply causality; with one, the mask is used;
- ``add_bias_kv`` and ``add_zero_attn`` append a key (and value) at the END of the global
  key sequence: the last rank of the axis appends them to its shard.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..collectives.primitives import all_gather, axis_index, axis_size
from ..core.errors import SpecError
from ..core.mesh import Mesh, check_mesh
from ..core.spec import as_spec, entry_axes

__all__ = ["MultiheadAttention"]

_STRATEGIES = ("ring", "heads")


class MultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose input sequence may be split over a mesh axis.

    Same constructor, parameters and ``state_dict`` keys as torch's (``in_proj_weight``
    or ``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``, ``bias_k``/``bias_v``), so
    checkpoints load both ways; plus ``mesh=``, ``spec=`` and ``strategy=``. With
    ``mesh=None`` it is torch's module.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
            batch_first, device, dtype: as torch's.
        mesh: the mesh the forward runs on, or None (one device: torch's forward).
        spec: the ``P`` of ``query`` as the forward gets it (``(N, L, E)`` with
            ``batch_first``, else ``(L, N, E)``; ``(L, E)`` unbatched): its sequence dim
            may be split (the attention then runs domain-parallel), its batch dim too
            (data parallel: nothing moves for it); the feature dim must be whole.
        kv_spec: the ``P`` of ``key`` and ``value`` (default ``spec``): their sequence
            dim split over the same axes as the query's (uneven sizes and another
            length are fine), or whole (every rank holds all keys: cross-attention to a
            small context, no communication).
        strategy: ``"ring"`` (default: any head count; K/V blocks travel, each rank
            keeps its rows) or ``"heads"`` (``spmd.ops.head_parallel_attention``: fewer
            bytes when batch x heads is at least the number of ranks).

    Forward: torch's arguments. Over a split sequence:

    - ``key_padding_mask`` ``(N, S)`` is split along S like the keys;
    - ``attn_mask`` ``(L, S)`` or ``(N * num_heads, L, S)`` holds this rank's query rows
      and all S key columns (the convention of ``spmd.ops.ring_attention``);
    - ``need_weights`` defaults to False when a mesh is given (True refuses: the
      weights are the whole L x S matrix) and to torch's True without one;
    - dropout > 0 in training refuses (the random pattern could not match one device's);
      in eval it does nothing, as in torch.

    Communication:
        That of the chosen strategy's op over the sequence axes, plus one all_gather of
        the key padding mask when one is given.

    Backward:
        Through the op's backward; parameters get partial gradients per rank, which
        shard_map (or ``spmd.parallel``) sums, as for any layer.

    Ranks without data:
        A rank with no query rows or no keys takes part in every collective and returns
        an empty output.

    Raises:
        SpecError: a split feature dim; keys split otherwise than the query; an
            attention mask whose key dim is split; ``need_weights=True``, ``static_k`` or
            ``static_v`` over a split sequence.
        NotImplementedError: dropout > 0 in training over a split sequence.
        ValueError: an unknown strategy.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> attn = spmd.nn.MultiheadAttention(8, 2, batch_first=True, mesh=mesh,
        ...                                   spec=P(None, "sp"))
        >>> plain = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        >>> plain.load_state_dict(attn.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(2, 5, 8)
        >>> f = lambda x: attn(x, x, x)[0]
        >>> y = spmd.shard_map(f, mesh, P(None, "sp"), P(None, "sp"))(x)
        >>> torch.allclose(y, plain(x, x, x, need_weights=False)[0], atol=1e-6)
        True
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0,
                 bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: int | None = None, vdim: int | None = None, batch_first: bool = False,
                 device: Any = None, dtype: torch.dtype | None = None, *,
                 mesh: Mesh | None = None, spec: Any = None, kv_spec: Any = None,
                 strategy: str = "ring"):
        super().__init__(embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim,
                         vdim, batch_first, device, dtype)
        self._configure(mesh, spec, kv_spec, strategy)

    def _configure(self, mesh: Any, spec: Any, kv_spec: Any, strategy: Any) -> None:
        name = type(self).__name__
        check_mesh(mesh, name, optional=True)
        if strategy not in _STRATEGIES:
            raise ValueError(f"{name}: strategy must be 'ring' or 'heads', got {strategy!r}")
        if mesh is not None and spec is None:
            raise TypeError(f"{name}: pass spec= (the query's P) with mesh=")
        specs = []
        for what, s in (("spec", spec), ("kv_spec", kv_spec)):
            s = None if s is None else as_spec(s, f"{name}: {what}")
            if s is not None and mesh is not None:
                for a in s.axes:
                    mesh.check_axes(a, f"{name}: {what}")
            specs.append(s)
        self.mesh, self.spec, self.kv_spec, self.strategy = mesh, specs[0], specs[1], strategy

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, mesh: Mesh | None, spec: Any, *,
                   kv_spec: Any = None, strategy: str = "ring") -> MultiheadAttention:
        """The sharded twin of ``module``, sharing its parameters (no copy)."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"{cls.__name__}.from_torch expects an nn.MultiheadAttention, got "
                            f"{type(module).__name__}")
        new = cls.__new__(cls)
        new.__dict__.update(module.__dict__)
        new._configure(mesh, spec, kv_spec, strategy)
        return new

    def to_torch(self) -> nn.MultiheadAttention:
        """The plain torch module, sharing parameters."""
        base = nn.MultiheadAttention.__new__(nn.MultiheadAttention)
        base.__dict__.update({k: v for k, v in self.__dict__.items()
                              if k not in ("mesh", "spec", "kv_spec", "strategy")})
        return base

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, mesh={self.mesh!r}, "
                f"spec={self.spec!r}, strategy={self.strategy!r}")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool | None = None,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """torch's forward on this rank's shards (see the class)."""
        if self.mesh is None:
            return super().forward(query, key, value, key_padding_mask,
                                   True if need_weights is None else need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        need_weights = bool(need_weights)
        batched = query.dim() == 3
        first = self.batch_first and batched
        seq_q, seq_kv = _seq_entries(self, query, key, first)
        if seq_q is None and seq_kv is None:  # nothing split along the sequence
            return super().forward(query, key, value, key_padding_mask, need_weights,
                                   attn_mask, average_attn_weights, is_causal)
        if first:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, w = sharded_mha_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn, self.dropout,
            self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights,
            attn_mask=attn_mask, use_separate_proj_weight=not self._qkv_same_embed_dim,
            q_proj_weight=self.q_proj_weight, k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight, average_attn_weights=average_attn_weights,
            is_causal=is_causal, mesh=self.mesh, axes=seq_q, kv_split=seq_kv is not None,
            key_padding_mask_split=seq_kv is not None, strategy=self.strategy)
        return (out.transpose(1, 0) if first else out), w


def _seq_entries(m: MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                 first: bool) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """The axes splitting the sequence dim of query and of key/value (None: whole)."""
    name = type(m).__name__
    out = []
    for what, spec, x in (("spec", m.spec, query), ("kv_spec", m.spec if m.kv_spec is None else m.kv_spec, key)):
        if len(spec) > x.dim():
            raise SpecError(f"{name}: {what} {spec!r} has {len(spec)} entries but the input "
                            f"has {x.dim()} dims")
        if spec.entry(x.dim() - 1) is not None:
            raise SpecError(f"{name}: {what} {spec!r} splits the feature dim (the last); "
                            f"attention contracts it: keep it whole")
        seq = 1 if first else 0
        e = entry_axes(spec.entry(seq))
        out.append(tuple(e) if e else None)
    q, kv = out
    if q is None and kv is not None:
        raise SpecError(f"{name}: the keys are split over {kv} but the queries are whole; "
                        f"split the query's sequence the same way")
    if kv is not None and kv != q:
        raise SpecError(f"{name}: the query's sequence is split over {q} and the keys' over "
                        f"{kv}; split both over the same axes (or keep the keys whole)")
    return q, kv


# -- the sharded F.multi_head_attention_forward ------------------------------------------------

def sharded_mha_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        embed_dim_to_check: int, num_heads: int,
                        in_proj_weight: torch.Tensor | None, in_proj_bias: torch.Tensor | None,
                        bias_k: torch.Tensor | None, bias_v: torch.Tensor | None,
                        add_zero_attn: bool, dropout_p: float, out_proj_weight: torch.Tensor,
                        out_proj_bias: torch.Tensor | None, training: bool = True,
                        key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                        attn_mask: torch.Tensor | None = None,
                        use_separate_proj_weight: bool = False,
                        q_proj_weight: torch.Tensor | None = None,
                        k_proj_weight: torch.Tensor | None = None,
                        v_proj_weight: torch.Tensor | None = None,
                        static_k: torch.Tensor | None = None,
                        static_v: torch.Tensor | None = None, average_attn_weights: bool = True,
                        is_causal: bool = False, *, mesh: Mesh, axes: tuple[str, ...],
                        kv_split: bool = True, key_padding_mask_split: bool = True,
                        strategy: str = "ring") -> tuple[torch.Tensor, None]:
    """``F.multi_head_attention_forward`` (sequence first, as torch's) on this rank's rows
    of a sequence split over ``axes``; keys split the same way (``kv_split``) or whole.

    Not public: ``MultiheadAttention.forward`` and ``convert``'s rule call it. Checks come
    first, from arguments every rank has alike, before anything moves.
    """
    what = "MultiheadAttention"
    if need_weights:
        raise SpecError(f"{what}: need_weights=True over a sequence split over {axes} would "
                        f"build the whole L x S attention matrix on every rank; pass "
                        f"need_weights=False")
    if dropout_p > 0 and training:
        raise NotImplementedError(
            f"{what}: dropout={dropout_p} in training over a split sequence: the random "
            f"pattern could not match one device's; use dropout=0 (or eval mode)")
    if static_k is not None or static_v is not None:
        raise SpecError(f"{what}: static_k/static_v over a split sequence are not supported")
    if strategy not in _STRATEGIES:
        raise ValueError(f"{what}: strategy must be 'ring' or 'heads', got {strategy!r}")
    batched = query.dim() == 3
    if not batched:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    _, bsz, embed_dim = query.shape
    if embed_dim != embed_dim_to_check or embed_dim % num_heads:
        raise SpecError(f"{what}: query has {embed_dim} features, the layer {embed_dim_to_check} "
                        f"in {num_heads} heads")
    head_dim = embed_dim // num_heads
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool \
            and not key_padding_mask.is_floating_point():
        raise TypeError(f"{what}: key_padding_mask must be bool or floating")
    if attn_mask is not None and attn_mask.dim() not in (2, 3):
        raise SpecError(f"{what}: attn_mask must be (L, S) or (N * num_heads, L, S), got "
                        f"{list(attn_mask.shape)}")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the "
                           "Transformer module method `generate_square_subsequent_mask` to "
                           "create this mask.")  # torch's words
    causal = False
    if is_causal and key_padding_mask is None:
        attn_mask, causal = None, True  # torch's hint: SDPA's own causality
    else:
        attn_mask = _additive(attn_mask, query.dtype)
    last = kv_split and axis_index(axes) == axis_size(axes) - 1
    extra = (not kv_split or last)  # this rank appends bias_k / the zero key
    # the projections act per position
    if use_separate_proj_weight:
        bq, bk, bv = in_proj_bias.chunk(3) if in_proj_bias is not None else (None,) * 3
        q = F.linear(query, q_proj_weight, bq)
        k = F.linear(key, k_proj_weight, bk)
        v = F.linear(value, v_proj_weight, bv)
    else:
        wq, wk, wv = in_proj_weight.chunk(3)
        bq, bk, bv = in_proj_bias.chunk(3) if in_proj_bias is not None else (None,) * 3
        q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
    kpm = key_padding_mask
    if kpm is not None:
        kpm = _additive(kpm, query.dtype)
        if kv_split and key_padding_mask_split:  # (N, S_r) -> (N, S): small
            kpm = all_gather(kpm, axes, axis=1, tiled=True)
    pads = 0
    if bias_k is not None and bias_v is not None:
        if extra:
            k = torch.cat([k, bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, bias_v.repeat(1, bsz, 1)])
        pads += 1
    if add_zero_attn:
        if extra:
            k = torch.cat([k, k.new_zeros(1, bsz, embed_dim)])
            v = torch.cat([v, v.new_zeros(1, bsz, embed_dim)])
        pads += 1
    if pads:  # the appended keys are the last columns of the global masks
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, pads))
        kpm = None if kpm is None else F.pad(kpm, (0, pads))
    mask = None
    if attn_mask is not None:
        mask = attn_mask.unsqueeze(0) if attn_mask.dim() == 2 else \
            attn_mask.view(bsz, num_heads, attn_mask.shape[-2], attn_mask.shape[-1])
    if kpm is not None:
        kpm = kpm.view(bsz, 1, 1, kpm.shape[-1])
        mask = kpm if mask is None else mask + kpm
    # (L_r, N, H, head_dim): the sequence at dim 0, SDPA's (N, H, L, hd) once it is moved
    q4, k4, v4 = (t.view(t.shape[0], bsz, num_heads, head_dim) for t in (q, k, v))
    if mask is not None and mask.dim() == 3:
        mask = mask.unsqueeze(0)
    if kv_split:
        op = ops.ring_attention if strategy == "ring" else ops.head_parallel_attention
        out = op(q4, k4, v4, mesh, axes, seq_dim=0, causal=causal, attn_mask=mask)
    else:
        if causal:
            raise SpecError(f"{what}: is_causal with whole keys and queries split over {axes} "
                            f"needs each rank's global row offset; split the keys too")
        out = F.scaled_dot_product_attention(q4.movedim(0, -2), k4.movedim(0, -2),
                                             v4.movedim(0, -2), attn_mask=mask).movedim(-2, 0)
    out = F.linear(out.reshape(out.shape[0], bsz, embed_dim), out_proj_weight, out_proj_bias)
    return (out if batched else out.squeeze(1)), None


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """torch's canonical mask: bool True -> -inf (masked), float as it is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, -math.inf)
    return mask.to(dtype)
