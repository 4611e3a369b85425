"""Metadata of the torch backend's messages: dtype codes, shape rows, and the errors
that compare them (the same message on every rank that sees the same rows).

Metadata travels as int64 tensors, never pickled objects: a row is
``[dtype code, ndim, numel, *shape padded with -1 to _MAXDIM]``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core._format import axis_phrase, shape_str
from ..core.errors import CommError, SpecError
from ..core.mesh import Group
from .base import REDUCE_OPS

_MAXDIM = 16
_ROW = 3 + _MAXDIM  # dtype code, ndim, numel, shape padded with -1
_OPCODES = {"all_reduce": 1, "all_gather": 2, "reduce_scatter": 3, "all_to_all": 4,
            "permute": 5, "broadcast": 6, "barrier": 7, "scatter": 8,
            "left": 9}  # not a collective: a rank that stops tells the others (LEFT)
_OPNAMES = {v: k for k, v in _OPCODES.items()}
# Every dtype torch knows, in a fixed order: the same codes in every process.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_DCODE = {d: i for i, d in enumerate(_DTYPES)}
_ROPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_ROP_CODE = {op: i for i, op in enumerate(REDUCE_OPS)}

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone(memory_format=torch.contiguous_format)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (moving data ignores dtype)."""
    return t.view(-1).view(torch.uint8)


def _piece_bytes(t: torch.Tensor) -> torch.Tensor:
    """``_bytes`` of a contiguous piece whose dims of size 1 may have any stride (a
    piece of a strided view: ``view`` keeps those strides and then refuses the bytes)."""
    return _bytes(t.as_strided((t.numel(),), (1,)))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _rop(op: str, dtype: torch.dtype, name: str):
    if op not in _ROPS:
        raise SpecError(f"{name}: reduction op must be one of {REDUCE_OPS}, got {op!r}")
    if dtype == torch.bool:  # torch's bool sum is logical or, like max
        return _ROPS["min" if op == "min" else "max"]
    if dtype.is_complex and op != "sum":
        raise SpecError(f"{name}: op {op!r} is not defined for complex tensors; use 'sum'")
    return _ROPS[op]


def _reducible(t: torch.Tensor) -> torch.Tensor:
    """A view of contiguous ``t`` that process groups can reduce (bool, complex)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def _unreducible(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return flat.view(torch.bool)
    if dtype.is_complex:
        return torch.view_as_complex(flat.view(-1, 2))
    return flat


def wire_op(op: str, dtype: torch.dtype) -> str:
    """The op on the wire: bool sums are logical or (max); min is max of reversed values
    (``reverse_``), so that NaN handling needs one flag (``TorchComm.all_reduce``)."""
    if dtype == torch.bool and op == "sum":
        return "max"
    return "sum" if op == "sum" else "max"


def reverse_(t: torch.Tensor) -> torch.Tensor:
    """Reverse the order of ``t``'s values in place (its own inverse): min = rev(max(rev))."""
    if t.is_floating_point():
        return t.neg_()
    return t.bitwise_not_()


def _norm_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not -x.ndim <= dim < max(x.ndim, 1) or x.ndim == 0:
        raise SpecError(f"{name}: dim {dim} is out of range for {shape_str(x.shape, x.dtype)}")
    return dim % x.ndim


def _row(t: torch.Tensor, name: str) -> list[int]:
    return _row_of(tuple(t.shape), t.dtype, name)


def _row_of(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> list[int]:
    if len(shape) > _MAXDIM:
        raise NotImplementedError(f"{name}: tensors with more than {_MAXDIM} dims are not "
                                  f"supported by the torch backend, got {len(shape)} dims")
    code = _DCODE.get(dtype, len(_DTYPES))
    return [code, len(shape), _numel(shape), *shape] + [-1] * (_MAXDIM - len(shape))


def _dtype(code: int, name: str) -> torch.dtype:
    if 0 <= code < len(_DTYPES):
        return _DTYPES[code]
    raise CommError(f"{name}: received a tensor of a dtype this process does not know")


def _describe_row(r: list[int]) -> str:
    dt = _DTYPES[r[0]] if 0 <= r[0] < len(_DTYPES) else None
    return shape_str(r[3:3 + r[1]], dt)


def _check_rows(rows: list[list[int]], group: Group, name: str, *, skip_dim=None,
                chunk=None) -> None:
    """threads.py's ``_same_meta`` on metadata rows (same message on every rank)."""
    r0 = rows[0]
    for i, r in enumerate(rows[1:], 1):
        a, b = list(r0[:2] + r0[3:]), list(r[:2] + r[3:])
        if skip_dim is not None and r0[1] == r[1]:
            a[2 + skip_dim] = b[2 + skip_dim] = -1
        if a != b:
            what = f" chunk {chunk}:" if chunk is not None else ""
            raise CommError(
                f"{name} over {_axes(group)}:{what} rank {group.ranks[0]} passed "
                f"{_describe_row(r0)} but rank {group.ranks[i]} passed {_describe_row(r)}; every "
                f"rank must pass the same dtype and shape"
                + (f" (except along dim {skip_dim})" if skip_dim is not None else ""))


def _extra(op: str, a: int, b: int) -> tuple[str, object, object]:
    if op == "reduce_scatter" and a & 0xFF == b & 0xFF:  # the chunk shapes' hash differs
        return "chunk shapes", "one set", "another"
    if op in ("all_reduce", "reduce_scatter"):
        return "reduction op", repr(REDUCE_OPS[a & 0xFF]), repr(REDUCE_OPS[b & 0xFF])
    if op == "all_gather":
        return "dim", a, b
    if op in ("broadcast", "scatter"):
        return "src", a, b
    return "pairs", "one set", "another"


def _plans_disagree(name: str, group: Group, rank: int, want: list[int], src: int,
                    sent: list[int], example: str, tail: str = "",
                    verb: str = "sends") -> CommError:
    """Rank ``rank`` expected metadata row ``want`` from rank ``src``, which sends ``sent``."""
    return CommError(f"{name} over {_axes(group)}: rank {rank} expected {_describe_row(want)} "
                     f"from rank {src} but it {verb} {_describe_row(sent)}; the ranks' plans "
                     f"disagree (an argument that differs from rank to rank, e.g. {example})"
                     f"{tail}", op=name, axes=group.axes)


def _axes(group: Group) -> str:
    return axis_phrase(group.axes)


def _plan_row(mismatch: tuple | None) -> list[int]:
    """[found, sender, expected row..., received row...] (int64), for _check_plan."""
    if mismatch is None:
        return [0, -1] + [-1] * (2 * _ROW)
    sender, exp, got = mismatch
    return [1, sender, *exp, *got]

