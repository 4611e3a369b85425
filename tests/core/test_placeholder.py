"""spmd.Placeholder: what a rank holds where a tensor is not valid."""
import dataclasses
import pickle

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spmd import Layout, Mesh, P, Placeholder

CPU = torch.device("cpu")


def ph(shape=(8, 16), dtype=torch.float32, requires_grad=False, layout=None, holders=(0,)):
    return Placeholder(torch.Size(shape), dtype, CPU, requires_grad, layout, holders)


# -- repr --------------------------------------------------------------------------------


def test_repr_one_holder():
    assert repr(ph()) == "Placeholder(f32[8, 16], on rank 0)"
    assert str(ph(holders=(3,))) == "Placeholder(f32[8, 16], on rank 3)"


def test_repr_several_holders():
    assert repr(ph(holders=(0, 1))) == "Placeholder(f32[8, 16], on ranks [0, 1])"


def test_repr_requires_grad():
    assert repr(ph(requires_grad=True)) == "Placeholder(f32[8, 16], on rank 0, requires_grad)"
    assert (repr(ph(dtype=torch.float64, requires_grad=True, holders=(2, 3)))
            == "Placeholder(f64[8, 16], on ranks [2, 3], requires_grad)")


@pytest.mark.parametrize("dtype, short", [
    (torch.float64, "f64"), (torch.bfloat16, "bf16"), (torch.int64, "i64"),
    (torch.bool, "bool"), (torch.complex64, "c64"), (torch.uint8, "u8")])
def test_repr_dtypes(dtype, short):
    assert repr(ph((3,), dtype)) == f"Placeholder({short}[3], on rank 0)"


def test_repr_scalar_and_empty():
    assert repr(ph(())) == "Placeholder(f32[], on rank 0)"
    assert repr(ph((0, 4))) == "Placeholder(f32[0, 4], on rank 0)"


def test_docstring_example():
    p = Placeholder(torch.Size([8, 16]), torch.float32, torch.device("cpu"), False, None, (0,))
    assert repr(p) == "Placeholder(f32[8, 16], on rank 0)"


# -- construction and normalisation --------------------------------------------------------


def test_fields_are_normalised():
    p = Placeholder([2, 3], torch.float32, "cpu", False, None, [1, 2])
    assert isinstance(p.shape, torch.Size) and p.shape == (2, 3)
    assert isinstance(p.device, torch.device) and p.device == CPU
    assert p.holders == (1, 2) and isinstance(p.holders, tuple)
    assert p == Placeholder(torch.Size([2, 3]), torch.float32, CPU, False, None, (1, 2))


def test_immutable():
    p = ph()
    for field, value in (("shape", torch.Size([1])), ("holders", (1,)), ("requires_grad", True),
                         ("layout", None), ("dtype", torch.float64)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(p, field, value)
    assert p == ph()


def test_like():
    x = torch.zeros(4, 6, dtype=torch.float64, requires_grad=True)
    lay = Layout((4, 6), P("sp"), Mesh(2, "sp"))
    p = Placeholder.like(x, [0, 1], lay)
    assert p.shape == x.shape
    assert p.dtype == torch.float64
    assert p.device == x.device
    assert p.requires_grad is True
    assert p.layout is lay
    assert p.holders == (0, 1)
    assert repr(p) == "Placeholder(f64[4, 6], on ranks [0, 1], requires_grad)"


def test_like_defaults():
    x = torch.ones(3, dtype=torch.int32)
    p = Placeholder.like(x, (2,))
    assert p.layout is None
    assert p.requires_grad is False
    assert p == Placeholder(torch.Size([3]), torch.int32, CPU, False, None, (2,))


def test_like_holders_generator():
    p = Placeholder.like(torch.zeros(2), (r for r in (0, 3)))
    assert p.holders == (0, 3)


# -- tensor-like queries -------------------------------------------------------------------


def test_shape_queries():
    p = ph((8, 16, 3))
    assert p.ndim == 3
    assert p.dim() == 3
    assert p.numel() == 8 * 16 * 3
    assert p.size() == torch.Size([8, 16, 3])
    assert p.size(0) == 8
    assert p.size(-1) == 3
    assert ph(()).ndim == 0
    assert ph(()).numel() == 1
    assert ph((0, 5)).numel() == 0


@given(st.lists(st.integers(0, 6), max_size=4))
def test_queries_match_a_tensor(shape):
    x = torch.empty(shape)
    p = Placeholder.like(x, (0,))
    assert p.ndim == x.ndim and p.dim() == x.dim()
    assert p.numel() == x.numel()
    assert p.size() == x.size()
    for d in range(-x.ndim, x.ndim):
        assert p.size(d) == x.size(d)


# -- pytree leaf ---------------------------------------------------------------------------


def test_is_a_single_optree_leaf():
    p = ph()
    leaves, treedef = optree.tree_flatten([p, {"a": p}])
    assert len(leaves) == 2
    assert all(leaf is p for leaf in leaves)
    assert optree.tree_unflatten(treedef, leaves) == [p, {"a": p}]


def test_is_a_leaf_in_the_spmd_namespace():
    p = ph(layout=Layout((8, 16), P("sp"), Mesh(2, "sp")))
    leaves, _ = optree.tree_flatten((p, [p]), none_is_leaf=True, namespace="spmd")
    assert leaves == [p, p] and all(leaf is p for leaf in leaves)


def test_tree_map_sees_placeholders():
    p = ph()
    out = optree.tree_map(lambda v: isinstance(v, Placeholder), {"x": p, "y": [torch.zeros(1), p]})
    assert out == {"x": True, "y": [False, True]}


# -- equality and pickling -----------------------------------------------------------------


def test_equality():
    assert ph() == ph()
    assert hash(ph()) == hash(ph())
    assert ph() != ph((8, 15))
    assert ph() != ph(dtype=torch.float64)
    assert ph() != ph(requires_grad=True)
    assert ph() != ph(holders=(1,))
    assert ph() != ph(holders=(0, 1))
    lay = Layout((8, 16), P("sp"), Mesh(2, "sp"))
    assert ph(layout=lay) == ph(layout=Layout((8, 16), P("sp"), Mesh(2, "sp")))
    assert ph(layout=lay) != ph()
    assert ph(layout=lay) != ph(layout=Layout((8, 16), P("sp"), Mesh(2, "sp"), {0: [3, 5]}))
    assert ph() != "Placeholder(f32[8, 16], on rank 0)"
    assert len({ph(), ph(), ph(holders=(1,))}) == 2


def test_pickle_round_trip():
    p = ph()
    q = pickle.loads(pickle.dumps(p))
    assert q == p and repr(q) == repr(p)


def test_pickle_round_trip_with_layout():
    mesh = Mesh((2, 2), ("dp", "sp"))
    lay = Layout((7, 16), P(("sp", "dp")), mesh, {0: [1, 2, 0, 4]})
    p = Placeholder.like(torch.zeros(7, 16, dtype=torch.float64, requires_grad=True), (0, 2), lay)
    q = pickle.loads(pickle.dumps(p))
    assert q == p
    assert hash(q) == hash(p)
    assert q.layout == lay and q.layout.sizes == lay.sizes
    assert isinstance(q.layout.spec, P)
    assert [q.layout.slices(r) for r in range(4)] == [lay.slices(r) for r in range(4)]
    assert repr(q) == "Placeholder(f64[7, 16], on ranks [0, 2], requires_grad)"

