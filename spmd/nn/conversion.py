"""``spmd.nn.convert``: a copy of a model whose forward runs on shards, exactly, or refuses.

The copy keeps every layer, parameter and ``state_dict`` key; what changes is how its
forward runs: under the layout interpreter (``interpreter.py``), which follows which dims
of every tensor are split and, call by call, passes what acts per position, swaps what
has a domain-parallel twin (convolutions, pools, interpolation, padding, reductions and
losses over split dims, attention over a split sequence) and refuses what would be wrong on shards, naming the layer, the
source line, the split dim and the fix.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..core.errors import SpecError
from ..core.mesh import Mesh, check_mesh
from ..core.spec import P, as_spec
from . import entry, interpreter
from .modules import _Sharded
from .spectral import SpectralConv1d, SpectralConv2d, SpectralConv3d

__all__ = ["convert", "UNSAFE"]

#: Layers whose forward mixes values across positions (statistics, flattening,
#: attention). ``convert`` does not refuse them by type: it checks each call they make,
#: so a norm whose statistics span no split dim passes and one that spans one is refused.
UNSAFE: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LayerNorm,
    nn.LocalResponseNorm, nn.Flatten, nn.Unflatten, nn.Fold, nn.Unfold, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


def convert(model: nn.Module, mesh: Mesh, spec: Any, *, example: Any = None,
            types: Mapping[type[nn.Module], type] | None = None,
            allow: Iterable[Any] = (), report: bool = False,
            strict: bool = False) -> nn.Module:
    """A copy of ``model`` whose forward, given this rank's shards of inputs laid out by
    ``spec``, computes this rank's shards of what ``model`` computes on the whole inputs:
    exactly, or it raises a ``SpecError`` on every rank before anything runs.

    The forward is followed call by call (``torch.nn`` layers, ``torch.nn.functional``
    calls, tensor methods, in any control flow), each tensor with the dims that are split:

    - calls that act per position, or only along whole dims, run unchanged;
    - convolutions, transposed convolutions, pools (LPPool too), interpolation and
      padding along split dims run their ``spmd.ops`` twin (halo exchange);
      ``sum``/``mean``/``amax``/``amin`` over split dims run ``spmd.reduce``; norms and
      softmax over split dims run ``spmd.ops``' twins; MSE, L1, smooth L1, Huber,
      cross-entropy and NLL losses run ``spmd.ops``' (one psum), BCE and KL per
      position, then ``spmd.reduce``;
    - ``F.scaled_dot_product_attention`` over a split sequence (dim -2 of q, k, v split
      over the same axes) runs ``spmd.ops.ring_attention``, and ``nn.MultiheadAttention``
      (``nn.TransformerEncoderLayer``'s too) over a split sequence runs the forward of
      ``spmd.nn.MultiheadAttention``; attention weights (``need_weights=True``, the
      layer's default: pass False), dropout in training, a split feature dim and masks
      whose rows are not split like the queries are refused;
    - ``flatten`` whose first flattened dim is split (a patch grid's rows become a run of
      tokens per rank) keeps it split; a whole tensor as long as a split dim's global
      size, combined elementwise with a split one (a learned positional table added to
      split tokens), is cut to this rank's part (one size exchange, at the first call);
    - random draws whose result several ranks hold alike (``nn.Dropout`` after a mean
      over split dims, a timestep ``torch.randint(0, 1000, (b,))``, ``nn.Dropout2d``'s
      channel mask on split dims) come from a stream those ranks share; a draw on a
      tensor split over every mesh axis is each rank's own; under
      ``spmd.random.invariant(seed)`` each is a function of the global index;
    - every split activation carries its layout (shard sizes), from the inputs' (a
      ``spmd.Sharded`` input's uneven sizes too): a call that keeps a dim's length keeps
      its sizes (a conv layer with a reflect, replicate or circular ``padding_mode`` runs
      as one ``spmd.ops`` conv and keeps them too), a pool or an interpolation gives its
      twin's layout; where two operands are split with other sizes (a skip ``torch.cat``,
      a residual add, a loss's target), the cheaper one is redistributed to the other's
      layout, moving only the rows that change owner (the plan lists the move and its
      bytes);
    - calls that mix positions along a split dim with no twin (``torch.roll``, slicing or
      ``cat`` along it, a ``flatten`` that puts it behind another dim, a matmul over it,
      an FFT over it, ``F.unfold``'s patches across it, ``F.interpolate`` with
      ``mode='area'`` or ``antialias=True`` along it, a ``linspace`` of this rank's
      size, ...) are refused.

    A split dim's size in arithmetic is refused, also where Python made it a plain
    number (``math.sqrt(x.shape[2])``, ``0.5 * h``, ``int(h * 1.5)``): the plan runs a
    second time with other sizes of the split dims and refuses a number given to a torch
    call that changed with them, and a loop or branch on such a size that makes other
    calls. Not seen: a number that agrees at both sizes (``h % 8``), and the backward of
    a user's ``torch.autograd.Function``.

    Before the first call with a given input signature, the forward runs on a planning
    copy of the layers (their Python attributes copied, their parameters and buffers
    meta tensors: no memory, no communication) to make the plan; a refusal there
    raises on every rank alike before anything runs. ``model.spmd_plan`` is the latest
    plan. What the forward does to its layers' state (a step counter, a buffer updated in
    place, a first-call initialisation from the data) happens in the real call only: one
    call leaves the state one call on one device leaves. On a threads mesh of more than
    one rank every rank thread runs the one model: buffers the forward updates in place
    (``self.n += 1``, a running mean, torch's batch and instance norms' running
    statistics) are updated by each rank thread on its own copy and written back once,
    with the value the ranks agree on (they raise, naming the buffer, where they do
    not); any other change (an attribute, a parameter, a buffer
    replaced) is refused before anything runs, naming the layer path and the attribute.
    Where the plan cannot see the change (after a branch on data), the call raises
    after the forward. Layers not looked into (``types=``, ``allow=``, ``spmd.nn``
    layers) keep their state to themselves. Side effects outside the model (a print, a
    list or counter of your own that the forward or a hook appends to) happen in the
    plan too (once per planning run): keep them out of forward, or let them see meta
    tensors. Parameters, buffers and ``state_dict`` keys are unchanged; ``model``
    itself is not modified. Run the result inside ``spmd.shard_map`` (or per-rank code).

    Args:
        model: the single-device model.
        mesh: the mesh.
        spec: how the forward's tensor inputs are split: one ``P`` for all of them, a
            sequence with one ``P`` (or None: whole) per positional input, or a dict from
            the forward's parameter names to a ``P`` (or None), which reaches keyword
            inputs too (``{"x": P("sp"), "key_padding_mask": P(None, "sp")}``); inputs
            it does not name are whole.
        example: the global input (a tensor), its global shape, a tuple of those per
            input, or a dict of them by parameter name: plan now, and raise now on a refusal (or print the plan with
            ``report``). Only shapes and dtypes are used.
        types: ``{layer type: replacement type}``: layers swapped for a replacement
            (``from_torch(module, mesh, spec)``) that handles shards itself; the
            interpreter does not look inside them. ``{YourFNOLayer:
            spmd.nn.SpectralConv2d}`` takes a layer holding the reference FNO's weights.
            spmd's own spectral layers (``SpectralConv1d/2d/3d``, also inside
            ``spmd.nn.FNO``) built for one device are swapped for their sharded selves
            without being named here.
        allow: layer types and functions you know are right on shards here: the
            interpreter does not look inside those layers, and passes those functions;
            their outputs are split like their first input.
        report: print the plan (needs ``example``) instead of raising on refusals, which
            then raise when the forward runs.
        strict: raise where the plan cannot cover the whole forward (a branch on data,
            which meta tensors do not have; a layer not looked into that calls spmd
            functions), instead of checking the rest call by call as it runs. Every call
            is checked either way; strict makes every refusal come before anything runs.

    Raises:
        SpecError: a call that would be wrong on shards (with ``example``, or at the first
            forward): where it is (layer path and source line), the split dim and the fix;
            a change of the layers' state in forward on a threads mesh that rank threads
            cannot each make on their own copy (layer path and attribute); a ``model``
            that ``convert`` made already (convert the original); a lazy layer whose
            parameters do not exist yet (call the model once first).

    Example:
        >>> mesh = spmd.Mesh((2,), ("sp",))
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(),
        ...                           torch.nn.MaxPool2d(2))
        >>> sharded = spmd.nn.convert(net, mesh, P(None, None, "sp"), example=(1, 1, 8, 8))
        >>> [e.call for e in sharded.spmd_plan.swapped]
        ['torch.conv2d', 'F.max_pool2d']
        >>> x = torch.randn(1, 1, 8, 8)
        >>> y = spmd.shard_map(sharded, mesh, P(None, None, "sp"), P(None, None, "sp"))(x)
        >>> torch.allclose(y, net(x), atol=1e-6)
        True
        >>> class Bad(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.roll(x, 1, dims=2)
        >>> spmd.nn.convert(Bad(), mesh, P(None, None, "sp"), example=(1, 1, 8, 8))
        Traceback (most recent call last):
        ...
        spmd.core.errors.SpecError: convert: 1 call(s) in Bad's forward would be wrong on shards ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    check_mesh(mesh, "convert")
    for path, m in model.named_modules():
        if "spmd_plan" in vars(m):
            where = f"its layer '{path}' is" if path else "it is"
            raise SpecError(
                f"convert: {type(model).__name__} cannot be converted: {where} already a "
                f"model made by spmd.nn.convert, whose forward runs on shards (of the mesh "
                f"it was made for); convert the original single-device model once, with the "
                f"mesh and spec it will run on")
        lazy = [k for k, t in list(m.named_parameters(recurse=False)) +
                list(m.named_buffers(recurse=False)) if is_lazy(t)]
        if lazy:
            raise SpecError(
                f"convert: {type(m).__name__} {f'(layer {path!r}) ' if path else ''}has "
                f"uninitialized parameters ({', '.join(lazy)}: a lazy layer sets them at "
                f"its first call); convert plans the forward on a copy of the model, and "
                f"rank threads would each set them: call the model once on one device with "
                f"a small input of the right channels first (model(torch.zeros(1, C, 8, "
                f"8))), then convert it")
    params = _parameters(model)
    spec = _specs(spec, mesh, params, type(model).__name__)
    allow = tuple(allow)
    allow_types = tuple(a for a in allow if isinstance(a, type) and issubclass(a, nn.Module))
    allow_funcs = frozenset(a for a in allow if not isinstance(a, type))
    for a in allow:
        if isinstance(a, type) and not issubclass(a, nn.Module) or not callable(a):
            raise TypeError(f"convert: allow takes nn.Module types and functions, got {a!r}")
    if report and example is None:
        raise TypeError("convert: report=True needs example= (the global input or its shape)")
    new = copy.deepcopy(model)
    replaced: tuple = ()
    # spmd's spectral layers on one device become their sharded selves (the same weights)
    types = {**{c: c for c in _SPECTRAL if any(type(m) is c for m in new.modules())},
             **(types or {})}
    if types:
        replaced = tuple(types.values())
        if type(new) in types:
            new = types[type(new)].from_torch(new, mesh, spec)
        else:
            swaps = []
            for _, parent in new.named_modules():
                for name, child in parent.named_children():
                    if type(child) in types:
                        swaps.append((parent, name, types[type(child)].from_torch(child, mesh, spec)))
            for parent, name, twin in swaps:
                setattr(parent, name, twin)
    cfg = entry.Config(mesh, spec, type(new).__name__, allow_types, allow_funcs,
                       replaced, strict, tuple(n for n, kind in params if kind == "positional"))

    def opaque(m: nn.Module) -> bool:
        return isinstance(m, allow_types + replaced + (_Sharded,))
    entry.install(new, cfg, opaque)
    new.spmd_plan = None  # also what marks a converted model
    if example is not None:
        plan = _plan_example(new, cfg, example)
        new.spmd_plan = plan
        if report:
            print(plan)
        elif plan.refused:
            raise plan.error()
        elif strict and plan.incomplete:
            raise SpecError(f"convert(strict=True): the plan of {plan.model}'s forward stops "
                            f"short: {plan.incomplete}")
    return new


_SPECTRAL = (SpectralConv1d, SpectralConv2d, SpectralConv3d)


def _parameters(model: nn.Module) -> list[tuple[str, str]]:
    """The forward's parameters (name, "positional" or "keyword"), ``*args`` and
    ``**kwargs`` left out."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional",
             inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [(n, kinds[p.kind]) for n, p in sig.parameters.items() if p.kind in kinds]


def _specs(spec: Any, mesh: Mesh, params: list[tuple[str, str]] = (), model: str = "") -> Any:
    if isinstance(spec, P):
        out = spec
    elif isinstance(spec, Mapping):
        names = [n for n, _ in params]
        unknown = [k for k in spec if k not in names]
        if unknown:
            raise SpecError(f"convert: spec names {', '.join(map(repr, unknown))}, which "
                            f"{model}.forward does not take (its parameters: "
                            f"{', '.join(names) or 'none'}); a spec by name maps the "
                            f"forward's parameter names to a P (or None: whole)")
        out = {k: None if s is None else as_spec(s, f"convert: spec[{k!r}]")
               for k, s in spec.items()}
        for s in out.values():
            for a in (s.axes if s is not None else ()):
                mesh.check_axes(a, "convert: spec")
        return out
    elif isinstance(spec, (tuple, list)):
        out = tuple(None if s is None else as_spec(s, f"convert: spec[{i}]")
                    for i, s in enumerate(spec))
    else:
        out = as_spec(spec, "convert: spec")
    for s in (out,) if isinstance(out, P) else out:
        for a in (s.axes if s is not None else ()):
            mesh.check_axes(a, "convert: spec")
    return out


def _plan_example(model: nn.Module, cfg: entry.Config, example: Any) -> interpreter.Plan:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                 torch.get_default_dtype())

    def meta(ex: Any, shp: Any) -> torch.Tensor:
        dt = ex.dtype if isinstance(ex, torch.Tensor) else dtype
        return torch.empty(shp, dtype=dt, device="meta")
    if isinstance(example, Mapping):  # by the forward's parameter names
        named = {k: meta(v, entry.example_shapes(v)[0]) for k, v in example.items()}
        args = []
        for n in cfg.params:  # the positional ones in order, as a caller passes them
            if n not in named:
                break
            args.append(named.pop(n))
        return cfg.plan(model, tuple(args), named, lambda a, e: list(a.shape),
                        global_sizes=True)
    shapes = entry.example_shapes(example)
    tensors = example if isinstance(example, (tuple, list)) and not \
        entry.is_shape(example) else (example,)
    args = [meta(ex, shp) for ex, shp in zip(tensors, shapes)]
    return cfg.plan(model, tuple(args), {}, lambda a, e: list(a.shape), global_sizes=True)
