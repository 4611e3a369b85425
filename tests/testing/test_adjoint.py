"""The dot-product test <T x, y> == <x, T* y> (float64) for every linear collective,
through spmd.testing.check_adjoint, on 1-d and 2-d meshes with uneven sizes."""
from __future__ import annotations

import pytest
import torch

import spmd
from spmd.testing import check_adjoint

F64 = torch.float64
MESHES = [((1,), ("a",), "a"), ((3,), ("a",), "a"), ((4,), ("a",), "a"),
          ((2, 3), ("a", "b"), "b"), ((2, 3), ("a", "b"), ("b", "a"))]


def _x(shape_of):
    return lambda r: torch.randn(shape_of(r), dtype=F64,
                                 generator=torch.Generator().manual_seed(100 + r))


def _ops(ax, n):
    """(name, per-rank linear op, input shape as a function of the rank)."""
    def idx():
        return spmd.axis_index(ax)
    return [
        ("psum", lambda x: spmd.psum(x, ax), lambda r: (3, 2)),
        ("pmean", lambda x: spmd.pmean(x, ax), lambda r: (3,)),
        ("all_gather", lambda x: spmd.all_gather(x, ax, axis=1), lambda r: (2, 3)),
        # Uneven: rank r holds r % 3 rows (zeros included).
        ("all_gather tiled", lambda x: spmd.all_gather(x, ax, tiled=True), lambda r: (r % 3, 2)),
        ("psum_scatter", lambda x: spmd.psum_scatter(x, ax, scatter_dimension=1),
         lambda r: (2, n)),
        ("psum_scatter tiled", lambda x: spmd.psum_scatter(x, ax, tiled=True),
         lambda r: (2 * n + 1, 2)),
        ("ppermute cyclic", lambda x: spmd.ppermute(x, ax, [(i, (i + 1) % n) for i in range(n)]),
         lambda r: (4,)),
        ("ppermute partial", lambda x: spmd.ppermute(x, ax, [(i, i + 1) for i in range(n - 1)]),
         lambda r: (2, 2)),
        ("all_to_all", lambda x: spmd.all_to_all(x, ax, 0, 1), lambda r: (n, 2)),
        ("all_to_all tiled", lambda x: spmd.all_to_all(x, ax, 0, 1, tiled=True),
         lambda r: (2 * n + 1, 3)),
        ("broadcast", lambda x: spmd.broadcast(x, ax, src=n - 1), lambda r: (3,)),
        ("composite", lambda x: spmd.psum(spmd.ppermute(x * (idx() + 1), ax,
                                                        [(i, (i + 1) % n) for i in range(n)]), ax),
         lambda r: (2,)),
    ]


@pytest.mark.parametrize("mesh_shape,names,ax", MESHES)
def test_collectives_are_adjoint(mesh_shape, names, ax):
    mesh = spmd.Mesh(mesh_shape, names)
    n = mesh.axis_size(ax)
    for name, op, shape_of in _ops(ax, n):
        try:
            check_adjoint(op, mesh, _x(shape_of), seed=len(name))
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_catches_a_wrong_backward():
    """A ppermute whose backward forgets to reverse the pairs fails the test."""
    @spmd.custom_vjp
    def bad_shift(x):
        return spmd.ppermute(x, "a", [(0, 1), (1, 2)])

    def fwd(x):
        return bad_shift(x), None

    def bwd(res, g):
        return (spmd.ppermute(g, "a", [(0, 1), (1, 2)]),)  # should be [(1, 0), (2, 1)]

    bad_shift.defvjp(fwd, bwd)
    mesh = spmd.Mesh((3,), ("a",))
    with pytest.raises(AssertionError, match=r"<T x, y> = .* but <x, T\* y> = "):
        check_adjoint(bad_shift, mesh, _x(lambda r: (4,)))


def _per_rank_adjoint(mesh):
    return check_adjoint(lambda x: spmd.all_gather(x, "a", tiled=True), mesh,
                         _x(lambda r: (r + 1, 2)))


def test_from_per_rank_code_sums_over_the_mesh():
    out = spmd.launch(_per_rank_adjoint, (3,), ("a",))
    assert all(o == out[0] for o in out)  # every rank gets the same totals
