"""spmd.P: partition specs with JAX semantics."""
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

import spmd
from spmd import P, SpecError
from spmd.testing import strategies as sst

AXES = ("a", "b", "c", "d", "e")


def specs():
    """The entries of a valid spec over AXES (up to 6 dims): each axis used at most once,
    as plain or tuple entries."""
    return sst.specs(spmd.Mesh((1,) * len(AXES), AXES), 6).map(list)


# -- valid entries -----------------------------------------------------------------------


def test_entries_none_name_tuple():
    p = P("dp", None, ("x", "y"))
    assert len(p) == 3
    assert p[0] == "dp"
    assert p[1] is None
    assert p[2] == ("x", "y")
    assert p.axes == ("dp", "x", "y")


def test_is_a_tuple():
    p = P("dp", None)
    assert isinstance(p, tuple)
    assert isinstance(p, P)
    assert len(p) == 2
    assert p[-1] is None
    assert list(p) == ["dp", None]
    assert p == ("dp", None)
    assert p[:1] == ("dp",)


def test_empty_spec():
    p = P()
    assert len(p) == 0
    assert p.axes == ()
    assert p.entry(0) is None
    assert p.entry(5) is None
    assert repr(p) == "P()"


def test_trailing_dims_may_be_left_out():
    p = P("sp")
    assert p.entry(0) == "sp"
    assert p.entry(1) is None
    assert p.entry(10) is None


def test_entry_within_len():
    p = P(None, ("x", "y"), "z")
    assert p.entry(0) is None
    assert p.entry(1) == ("x", "y")
    assert p.entry(2) == "z"
    assert p.entry(3) is None


def test_list_entry_becomes_tuple():
    p = P(["x", "y"])
    assert p[0] == ("x", "y")
    assert isinstance(p[0], tuple)


def test_empty_tuple_entry_means_not_split():
    assert P(()) == P(None)
    assert P(()).axes == ()


def test_axes_in_order_of_appearance():
    assert P(("c", "a"), None, "b").axes == ("c", "a", "b")


def test_repr():
    assert repr(P("dp", None, ("x", "y"))) == "P('dp', None, ('x', 'y'))"
    assert repr(P("sp")) == "P('sp')"
    assert repr(P(None)) == "P(None)"


def test_repr_evaluates_back():
    p = P("dp", None, ("x", "y"))
    assert eval(repr(p), {"P": P}) == p


def test_pickle_round_trip():
    p = P("dp", None, ("x", "y"))
    q = pickle.loads(pickle.dumps(p))
    assert q == p
    assert type(q) is P
    assert repr(q) == repr(p)
    assert q.axes == p.axes


def test_add_stays_a_spec():
    p = P("a") + P(None, "b")
    assert type(p) is P
    assert p == ("a", None, "b")
    with pytest.raises(SpecError, match="'a'"):
        P("a") + P("a")


def test_exported():
    assert spmd.P is P
    assert issubclass(SpecError, ValueError)


# -- errors ------------------------------------------------------------------------------


def test_axis_twice_plain():
    with pytest.raises(SpecError, match=r"'dp'.*twice"):
        P("dp", "dp")


def test_axis_twice_across_tuple_and_plain():
    with pytest.raises(SpecError, match=r"'x'.*twice"):
        P(("x", "y"), "x")
    with pytest.raises(SpecError, match=r"'y'.*twice"):
        P("y", None, ("x", "y"))


def test_axis_twice_within_tuple():
    with pytest.raises(SpecError, match=r"'x'.*twice"):
        P(("x", "x"))


def test_axis_twice_across_two_tuples():
    with pytest.raises(SpecError, match=r"'b'.*twice"):
        P(("a", "b"), ("c", "b"))


def test_axis_twice_message_names_dim():
    with pytest.raises(SpecError, match=r"dim 2"):
        P("a", None, "a")


@pytest.mark.parametrize("bad", [0, 1, 1.5, True, b"x", {"x"}, object()])
def test_invalid_entry(bad):
    with pytest.raises(SpecError, match="entry 1"):
        P("a", bad)


@pytest.mark.parametrize("bad", [("x", ("y",)), (("x", "y"),), ("x", None), ("x", 1), ["x", ["y"]]])
def test_nested_or_mixed_tuples_are_invalid(bad):
    with pytest.raises(SpecError, match="entry 0"):
        P(bad)


def test_spec_error_is_value_error():
    with pytest.raises(ValueError):
        P(3)


# -- properties --------------------------------------------------------------------------


@given(specs())
def test_valid_specs_round_trip(entries):
    p = P(*entries)
    assert len(p) == len(entries)
    assert list(p) == entries
    flat = [a for e in entries for a in ((e,) if isinstance(e, str) else (e or ()))]
    assert p.axes == tuple(flat)
    assert len(set(p.axes)) == len(p.axes)
    for d in range(len(entries) + 3):
        assert p.entry(d) == (entries[d] if d < len(entries) else None)
    assert pickle.loads(pickle.dumps(p)) == p
    assert eval(repr(p), {"P": P}) == p


@given(specs(), st.data())
def test_reusing_any_axis_raises(entries, data):
    p = P(*entries)
    if not p.axes:
        return
    a = data.draw(st.sampled_from(p.axes))
    pos = data.draw(st.integers(0, len(entries)))
    as_tuple = data.draw(st.booleans())
    extra = ("zz", a) if as_tuple else a
    bad = list(entries[:pos]) + [extra] + list(entries[pos:])
    with pytest.raises(SpecError, match=repr(a)):
        P(*bad)
