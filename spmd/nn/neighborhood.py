"""``spmd.nn.NeighborhoodAttention2d``: NATTEN's ``NeighborhoodAttention2D`` module (qkv
projection, heads, optional relative position bias, output projection) on a shard of a
channels-last field ``[batch, X, Y, channels]`` split along X and/or Y (and the batch),
or on one device with ``mesh=None``.

The projections act per token, so only the attention moves data: the key/value halo of
``spmd.ops.neighborhood_attention2d``. Parameter names follow NATTEN (``qkv``, ``rpb``,
``proj``), so its state dicts load.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..core._format import describe
from ..core.errors import SpecError
from ..core.layout import Layout
from ..core.mesh import Mesh, check_mesh
from ..core.spec import P, as_spec
from ..ops._window import _MeshOf
from ..ops.neighborhood_attention import _bools, _ints, neighborhood_attention2d

__all__ = ["NeighborhoodAttention2d"]


class NeighborhoodAttention2d(nn.Module):
    """2-D neighbourhood attention with projections, as NATTEN's ``NeighborhoodAttention2D``.

    ``y = proj(na2d(q, k, v))`` with ``q, k, v = qkv(x)`` split into ``num_heads`` heads.

    Args:
        dim: channels of the input and output (``num_heads * head_dim``).
        num_heads: attention heads; must divide ``dim``.
        kernel_size, dilation, is_causal: as ``spmd.ops.neighborhood_attention2d`` (an int
            or a bool, or one per spatial dim).
        rel_pos_bias: learn NATTEN's relative position bias ``rpb``, ``[num_heads,
            2 k_x - 1, 2 k_y - 1]`` (truncated normal, std 0.02, as NATTEN).
        qkv_bias: a bias in the qkv projection.
        qk_scale: the score scale, default ``head_dim ** -0.5``.
        num_kv_heads: key/value heads (grouped-query attention), dividing ``num_heads``;
            default ``num_heads`` (NATTEN's layer and state dict). With fewer, ``qkv``
            projects to ``dim + 2 * num_kv_heads * head_dim`` channels (q, then k, then
            v) and only the key/value heads travel in the halo.
        mesh: the mesh the layer runs on, or None (one device).
        spec: the input's spec (``P`` or ``Layout``) over ``[batch, X, Y, channels]``:
            batch, X and Y may be split, the channels not.
        device, dtype: of the parameters.

    Dropout is left out: it would draw different masks on every rank.

    Shapes:
        ``x``: ``[batch, X, Y, dim]`` (this rank's shard); the output has the same shape
        and split.

    Communication:
        That of ``neighborhood_attention2d``: the key/value rows outside the shard
        that the windows read, per split spatial dim; nothing else.

    Backward:
        Through the op (halo gradients go back to their owners). The parameters get
        this rank's partial gradients; shard_map's parameter rule (threads) or
        ``spmd.parallel`` (processes) sums them over ranks.

    Ranks without data:
        A rank holding no rows returns an empty output and serves its neighbours'
        halos (it has none to serve).

    Raises:
        ValueError: ``num_heads`` does not divide ``dim``, or ``num_kv_heads`` does not
            divide ``num_heads``.
        SpecError: a spec that splits the channels, an input that is not
            ``[batch, X, Y, dim]``, and the op's errors.

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> spec = P(None, "sp")  # [batch, X, Y, channels], X split
        >>> layer = spmd.nn.NeighborhoodAttention2d(8, 2, 3, rel_pos_bias=True, mesh=mesh,
        ...                                         spec=spec)
        >>> one = spmd.nn.NeighborhoodAttention2d(8, 2, 3, rel_pos_bias=True)
        >>> one.load_state_dict(layer.state_dict())
        <All keys matched successfully>
        >>> x = torch.randn(1, 5, 4, 8)
        >>> y = spmd.shard_map(layer, mesh, spec, spec)(x)
        >>> torch.allclose(y, one(x), atol=1e-5)
        True
    """

    def __init__(self, dim: int, num_heads: int, kernel_size: int | Sequence[int],
                 dilation: int | Sequence[int] = 1, is_causal: bool | Sequence[bool] = False,
                 rel_pos_bias: bool = False, qkv_bias: bool = True,
                 qk_scale: float | None = None, *, num_kv_heads: int | None = None,
                 mesh: Mesh | None = None, spec: Any = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        name = type(self).__name__
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for arg, v in (("dim", dim), ("num_heads", num_heads), ("num_kv_heads", kv_heads)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: {arg} must be a positive int, got {v!r}")
        if dim % num_heads:
            raise ValueError(f"{name}: num_heads={num_heads} must divide dim={dim}")
        if num_heads % kv_heads:
            raise ValueError(f"{name}: num_kv_heads={kv_heads} must divide "
                             f"num_heads={num_heads}")
        check_mesh(mesh, name, optional=True)
        if (mesh is None) != (spec is None):
            raise TypeError(f"{name}: pass mesh= and spec= (the input's P or Layout) together, "
                            f"or neither for one device")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.num_kv_heads = kv_heads
        self.kernel_size = _ints(kernel_size, 2, "kernel_size", name, 1)
        self.dilation = _ints(dilation, 2, "dilation", name, 1)
        self.is_causal = _bools(is_causal, 2, name)
        self.scale = qk_scale if qk_scale is not None else self.head_dim ** -0.5
        self.mesh, self.spec = mesh, _check_spec(spec, name)
        kw = dict(device=device, dtype=dtype)
        self.qkv = nn.Linear(dim, dim + 2 * kv_heads * self.head_dim, bias=qkv_bias, **kw)
        if rel_pos_bias:
            self.rpb = nn.Parameter(torch.empty(num_heads, *(2 * k - 1 for k in self.kernel_size),
                                                **kw))
            nn.init.trunc_normal_(self.rpb, std=0.02, mean=0.0, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)
        self.proj = nn.Linear(dim, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``proj(na2d(qkv(x)))`` on this rank's shard ``[batch, X, Y, dim]``."""
        if not isinstance(x, torch.Tensor) or x.ndim != 4 or x.shape[-1] != self.dim:
            raise SpecError(f"{type(self).__name__}: expected [batch, X, Y, {self.dim}] "
                            f"(channels last), got {describe(x)}")
        B, X, Y, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)
        if Hkv == H:
            q, k, v = qkv.view(B, X, Y, 3, H, D).unbind(3)
        else:
            q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split([H * D, Hkv * D, Hkv * D], -1))
        y = neighborhood_attention2d(q, k, v, self.kernel_size, self.dilation, self.is_causal,
                                     rpb=self.rpb, scale=self.scale, mesh=self.mesh,
                                     spec=self._qkv_spec(), enable_gqa=Hkv != H)
        return self.proj(y.reshape(B, X, Y, self.dim))

    def _qkv_spec(self) -> Any:
        """q's spec: the input's over batch, X, Y; heads and head_dim whole."""
        if self.spec is None or not isinstance(self.spec, Layout):
            return None if self.spec is None else P(*(self.spec.entry(d) for d in range(3)))
        lay = self.spec
        sizes = {d: lay.sizes[d] for d in range(3) if lay.sizes[d] is not None}
        return Layout((*lay.shape[:3], self.num_heads, self.head_dim),
                      P(*(lay.spec.entry(d) for d in range(3))), _MeshOf(lay), sizes or None)

    def extra_repr(self) -> str:
        kv = "" if self.num_kv_heads == self.num_heads else f", num_kv_heads={self.num_kv_heads}"
        s = (f"dim={self.dim}, num_heads={self.num_heads}{kv}, kernel_size={self.kernel_size}, "
             f"dilation={self.dilation}, is_causal={self.is_causal}, "
             f"rel_pos_bias={self.rpb is not None}")
        return s if self.mesh is None else f"{s}, mesh={self.mesh!r}, spec={self.spec!r}"


def _check_spec(spec: Any, name: str) -> Any:
    """``spec`` (a P, a Layout or None), refused where it splits the channels."""
    if spec is None:
        return None
    if not isinstance(spec, Layout):
        spec = as_spec(spec, f"{name}: spec")
    s = spec.spec if isinstance(spec, Layout) else spec
    if s.entry(3) is not None:
        raise SpecError(f"{name}: spec {s!r} splits the channels (dim 3); the projections mix "
                        f"all channels of a token, so split the batch or spatial dims only")
    if isinstance(spec, Layout) and len(spec.shape) != 4:
        raise SpecError(f"{name}: the layout is for a {len(spec.shape)}-d tensor; the input is "
                        f"[batch, X, Y, channels]")
    return spec
