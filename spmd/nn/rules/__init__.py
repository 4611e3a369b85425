"""What every torch call of a converted forward does on shards: pass, swap, or refuse.

The layout interpreter (``interpreter.py``) sees each torch call of the forward and asks
``rule_for(name)`` what to do with it. A rule looks at which dims of its tensor
arguments are split (their *entries*, ``_tags.py``) and either

- passes the call unchanged (it acts per position, or only along dims that are whole),
  and says how its outputs are split (``pointwise``, ``shapes``);
- swaps it for its domain-parallel twin (``spmd.ops.conv2d`` for ``F.conv2d``,
  ``spmd.reduce`` for a mean over a split dim, a local loss plus ``spmd.reduce``:
  ``windows``, ``mixing``); or
- refuses it (``Call.refuse``): it mixes positions along a split dim and has no twin.

Every decision depends only on the entries, the number of dims and the arguments, never
on this rank's sizes, so every rank decides alike.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ... import ops
from .. import flow
from ..hooks import tensor_hook
from ._base import (
    Call,
    PerOutput,
    Refused,
    _tensors,
    broadcast,
    like_input,
    op_name,
    passthrough,
    raise_refusal,
    refuse_if_split,
    unknown,
)
from .attn import attention, multi_head_attention
from .fourier import _FFT_FIX, fft
from .mixing import (
    batch_norm,
    bilinear,
    einsum,
    flip,
    group_norm,
    im2col,
    instance_norm,
    last_two,
    layer_norm,
    linear,
    matmul,
    pairwise,
    per_channel,
    pixel_shuffle,
    reduction,
    roll,
    scan,
    softmax,
    unfold,
)
from .per_position import (
    coordinates,
    creation,
    embedding,
    length,
    like,
    numel,
    one_hot,
    pointwise,
    random_like_mask,
    reads_values,
    same,
    shape,
    size,
    view_as_complex,
    view_as_real,
)
from .shapes import (
    along_dim,
    cat,
    expand,
    flatten,
    getitem,
    permutation,
    pieces,
    repeat,
    setitem,
    squeeze,
    stack,
    unflatten,
    unsqueeze,
    view,
    view_as,
)
from .windows import (
    _LOSSES,
    _adaptive,
    _indices_twin,
    _lp_pool,
    _twin,
    conv,
    interpolate,
    loss,
    materialize,
    pad,
)

__all__ = ["Call", "Refused", "PerOutput", "like_input", "rule_for", "op_name", "unknown",
           "raise_refusal", "materialize"]



_POINTWISE_EXTRA = {
    "dropout", "alpha_dropout", "feature_dropout", "rrelu", "hardswish", "logsigmoid",
    "softsign", "tanhshrink", "relu6", "floor_divide", "copy", "fill", "zero", "masked_fill",
    "masked_scatter", "where", "bernoulli", "uniform", "normal", "exponential", "geometric",
    "cauchy", "log_normal", "random", "clamp_min", "clamp_max", "gelu", "silu", "mish",
    "softplus", "threshold", "hardtanh", "leaky_relu", "elu", "selu", "celu", "sigmoid",
    "tanh", "relu", "hardsigmoid", "softshrink", "hardshrink", "polar", "complex", "real",
    "imag", "conj", "resolve_conj", "resolve_neg", "nan_to_num", "lerp",
    "addcmul", "addcdiv", "isclose", "heaviside", "bitwise_left_shift",
    "bitwise_right_shift", "logical_and", "logical_or", "logical_xor", "logical_not",
}


_SAME = {"to", "type", "contiguous", "clone", "detach", "float", "double", "half",
         "bfloat16", "int", "long", "short", "bool", "byte", "char", "cfloat", "cdouble",
         "cpu", "cuda", "requires_grad", "pin_memory", "get:data", "get:grad", "get:real",
         "get:imag", "align_to", "coalesce", "share_memory", "record_stream",
         "clone_", "detach_", "retain_grad", "as_subclass", "type_as"}


_NO_TENSOR_OUT = {"get:ndim", "dim", "ndimension", "get:dtype", "get:device", "get:layout",
                  "get:requires_grad", "get:is_leaf", "get:grad_fn", "get:is_cuda",
                  "get:is_meta", "get:names", "get:itemsize", "get:nbytes", "element_size",
                  "is_contiguous", "is_floating_point", "is_complex", "get_device",
                  "data_ptr", "stride", "storage_offset", "__repr__",
                  "__format__", "__str__", "__hash__", "__reduce_ex__", "__deepcopy__",
                  "__setstate__", "backward", "is_set_to", "untyped_storage", "storage",
                  "get:_base", "get:output_nr", "get:_version", "get:is_sparse",
                  "get:is_quantized", "get:is_nested", "get:is_mkldnn", "get:is_xpu",
                  "get:is_mps", "get:grad_dtype", "_is_view", "is_shared", "is_pinned",
                  "requires_grad_", "register_post_accumulate_grad_hook", "__dir__",
                  "get:__dict__", "__get__", "_set_grad_enabled",
                  "has_names", "dim_order", "is_inference"}


_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "nansum", "nanmean", "prod",
               "logsumexp", "var", "std", "var_mean", "std_mean", "norm", "count_nonzero",
               "argmax", "argmin", "median", "nanmedian", "mode", "all", "any", "aminmax",
               "quantile", "nanquantile", "linalg_vector_norm"}


_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort", "argsort",
          "msort", "topk", "kthvalue", "diff", "glu", "normalize", "unique_consecutive",
          "renorm"}


_TWINS: dict[str, Callable] = {}


for _n in (1, 2, 3):
    _TWINS[f"conv{_n}d"] = conv(_n)
    _TWINS[f"conv_transpose{_n}d"] = _twin(getattr(ops, f"conv_transpose{_n}d"))
    _TWINS[f"max_pool{_n}d"] = _twin(getattr(ops, f"max_pool{_n}d"))
    _TWINS[f"_max_pool{_n}d"] = _TWINS[f"max_pool{_n}d"]
    _TWINS[f"max_pool{_n}d_with_indices"] = _indices_twin(getattr(ops, f"max_pool{_n}d"))
    _TWINS[f"avg_pool{_n}d"] = _twin(getattr(ops, f"avg_pool{_n}d"))
    _TWINS[f"adaptive_avg_pool{_n}d"] = _adaptive(_n, is_max=False)
    _TWINS[f"adaptive_max_pool{_n}d"] = _adaptive(_n, is_max=True)
    _TWINS[f"_adaptive_max_pool{_n}d"] = _TWINS[f"adaptive_max_pool{_n}d"]
    _TWINS[f"adaptive_max_pool{_n}d_with_indices"] = _indices_twin(
        getattr(ops, f"adaptive_max_pool{_n}d"))
    _TWINS[f"lp_pool{_n}d"] = _lp_pool(_n)


_TWINS["interpolate"] = interpolate


_TWINS["pad"] = pad


def _aten_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    try:
        return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return False


_RULES: dict[str, Callable] = {
    **_TWINS,
    "get:shape": shape, "size": size, "numel": numel, "nelement": numel, "len": length,
    "item": reads_values, "tolist": reads_values, "numpy": reads_values,
    "nonzero": refuse_if_split("lists the positions of nonzero values"),
    "argwhere": refuse_if_split("lists the positions of nonzero values"),
    "unique": refuse_if_split("finds unique values over all positions"),
    "bincount": refuse_if_split("counts over all positions"),
    "histc": refuse_if_split("counts over all positions"),
    "histogram": refuse_if_split("counts over all positions"),
    "masked_select": refuse_if_split("gathers selected positions into one dim"),
    "take": refuse_if_split("indexes the flattened tensor"),
    "put": refuse_if_split("indexes the flattened tensor"),
    "put_": refuse_if_split("indexes the flattened tensor"),
    "zeros": creation, "ones": creation, "empty": creation, "full": creation,
    "rand": creation, "randn": creation, "new_zeros": creation, "new_ones": creation,
    "new_empty": creation, "new_full": creation, "randint": coordinates,
    "zeros_like": like, "ones_like": like, "empty_like": like, "full_like": like,
    "rand_like": like, "randn_like": like, "randint_like": like,
    "arange": coordinates, "linspace": coordinates, "logspace": coordinates,
    "range": coordinates, "eye": coordinates, "randperm": coordinates,
    "tril_indices": coordinates, "triu_indices": coordinates, "tensor": coordinates,
    "as_tensor": coordinates, "meshgrid": refuse_if_split("builds coordinate grids"),
    "cartesian_prod": refuse_if_split("combines all positions"),
    "softmax": softmax, "log_softmax": softmax, "softmin": softmax, "_softmax": softmax,
    "batch_norm": batch_norm, "instance_norm": instance_norm, "group_norm": group_norm,
    "layer_norm": layer_norm, "rms_norm": layer_norm, "local_response_norm": per_channel,
    "channel_shuffle": per_channel, "native_channel_shuffle": per_channel,
    "prelu": per_channel,
    "linear": linear, "bilinear": bilinear, "matmul": matmul, "mm": matmul, "bmm": matmul,
    "mv": matmul, "einsum": einsum, "embedding": embedding, "one_hot": one_hot,
    "view_as_real": view_as_real, "view_as_complex": view_as_complex,
    "scaled_dot_product_attention": attention,
    "multi_head_attention_forward": multi_head_attention,
    "cosine_similarity": pairwise, "pairwise_distance": pairwise,
    "dropout1d": random_like_mask, "dropout2d": random_like_mask,
    "dropout3d": random_like_mask, "feature_alpha_dropout": random_like_mask,
    "view": view, "reshape": view, "view_as": view_as, "reshape_as": view_as,
    "flatten": flatten, "ravel": flatten, "unflatten": unflatten, "squeeze": squeeze,
    "unsqueeze": unsqueeze, "permute": permutation, "transpose": permutation,
    "swapaxes": permutation, "swapdims": permutation, "t": permutation,
    "movedim": permutation, "moveaxis": permutation, "adjoint": permutation,
    "get:T": permutation, "get:mT": permutation, "get:H": permutation,
    "get:mH": permutation, "numpy_T": permutation,
    "expand": expand, "expand_as": expand, "broadcast_to": expand, "repeat": repeat,
    "tile": repeat, "cat": cat, "concat": cat, "concatenate": cat, "stack": stack,
    "split": pieces, "chunk": pieces, "tensor_split": pieces, "unbind": pieces,
    "split_with_sizes": pieces,
    "narrow": along_dim(1, "takes a range of positions"),
    "select": along_dim(1, "picks one position", keep="drop"),
    "index_select": along_dim(1, "selects positions"),
    "gather": along_dim(1, "gathers positions", keep="index"),
    "take_along_dim": along_dim(2, "gathers positions", keep="index"),
    "scatter": along_dim(1, "scatters to positions"),
    "scatter_add": along_dim(1, "scatters to positions"),
    "scatter_reduce": along_dim(1, "scatters to positions"),
    "index_add": along_dim(1, "adds at positions"),
    "index_copy": along_dim(1, "copies to positions"),
    "index_fill": along_dim(1, "fills positions"),
    "index_put": refuse_if_split("writes at indexed positions"),
    "__getitem__": getitem, "__setitem__": setitem,
    "roll": roll, "flip": flip, "fliplr": flip, "flipud": flip, "rot90": flip,
    "tril": last_two("keeps a triangle of the last two dims (position-dependent)"),
    "triu": last_two("keeps a triangle of the last two dims (position-dependent)"),
    "diagonal": last_two("takes a diagonal"), "diag": last_two("takes a diagonal"),
    "diag_embed": last_two("builds diagonals"), "trace": last_two("sums a diagonal"),
    "unfold": unfold, "fold": im2col, "im2col": im2col,
    "pixel_shuffle": pixel_shuffle, "pixel_unshuffle": pixel_shuffle,
    "grid_sample": refuse_if_split("samples at coordinates over the whole domain"),
    "affine_grid": refuse_if_split("builds coordinates over the whole domain"),
    "stft": refuse_if_split("transforms windows over a dim", _FFT_FIX),
    "istft": refuse_if_split("transforms windows over a dim", _FFT_FIX),
    "cdist": refuse_if_split("compares all pairs of positions"),
    "pdist": refuse_if_split("compares all pairs of positions"),
    "ctc_loss": refuse_if_split("aligns sequences"),
    "equal": reads_values, "allclose": reads_values, "is_nonzero": reads_values, "new_tensor": coordinates,
    "rmatmul": refuse_if_split("multiplies matrices (right operand)"),
    "broadcast_tensors": lambda c: (lambda c: c.out(c.call(), broadcast(c, _tensors(c))))(
        flow.agreed(c, _tensors(c))),
}


for _n in _REDUCTIONS:
    _RULES[_n] = reduction


for _n in _SCANS:
    _RULES[_n] = scan


for _n in _SAME:
    _RULES.setdefault(_n, same)


for _n in _NO_TENSOR_OUT:
    _RULES.setdefault(_n, passthrough)


_RULES["register_hook"] = tensor_hook


for _n in _LOSSES:
    _RULES[_n] = loss


for _n in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fft2", "ifft2", "rfft2", "irfft2",
           "hfft2", "ihfft2", "fftn", "ifftn", "rfftn", "irfftn", "hfftn", "ihfftn",
           "fftshift", "ifftshift"):
    _RULES[f"fft_{_n}"] = fft


@functools.lru_cache(maxsize=4096)
def rule_for(name: str) -> Callable | None:
    """The rule for ``name``, or None: a function spmd knows nothing about."""
    rule = _RULES.get(name)
    if rule is not None:
        return rule
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name
    if base != name and base in _RULES and _RULES[base] in (pointwise, same):
        return _RULES[base]
    if base in _POINTWISE_EXTRA or _aten_pointwise(base) or _aten_pointwise(base + "_"):
        return pointwise
    return None
