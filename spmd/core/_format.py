"""Short, consistent renderings of shapes, dtypes and specs for messages and reprs."""
from __future__ import annotations

from collections.abc import Sequence

import torch

_DTYPE_SHORT = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_str(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def shape_str(shape: Sequence[int], dtype: torch.dtype | None = None) -> str:
    """``f32[8, 16]`` (or ``[8, 16]`` without a dtype)."""
    body = "[" + ", ".join(str(int(s)) for s in shape) + "]"
    return (dtype_str(dtype) if dtype is not None else "") + body


def axis_phrase(axes: Sequence[str]) -> str:
    """``axis 'sp'`` for one mesh axis, ``axes ('dp', 'sp')`` for several, in messages."""
    return f"axis {axes[0]!r}" if len(axes) == 1 else f"axes {tuple(axes)!r}"


def describe(x: object) -> str:
    """What a value is, for error messages: ``f32[8, 16]`` for tensors, else its type."""
    if isinstance(x, torch.Tensor):
        return shape_str(x.shape, x.dtype)
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype"):
        return f"{type(x).__name__}({shape_str(shape, x.dtype)})"
    return type(x).__name__
