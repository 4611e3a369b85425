"""spmd.visualize: the text and figure of how a tensor is split, uneven and with halos."""
import subprocess
import sys

import pytest
import torch

import spmd
from spmd import Layout, Mesh, P, Placeholder, SpecError

MESH23 = Mesh((2, 3), ("x", "y"))
UNEVEN = Layout((7, 10), P("x", "y"), MESH23, sizes={0: [4, 3], 1: [5, 0, 5]})

GOLDEN = """\
[7, 10] P('x', 'y') over Mesh(x=2, y=3)
rows: dim 0 over 'x' [4, 3]
cols: dim 1 over 'y' [5, 0, 5]
  0                           5                          10
0 +---------------------------+---------------------------+
  |                           |                           |
  |        r0 (x=0,y=0)       |        r2 (x=0,y=2)       |
  |            4x5            |            4x5            |
  |                           |                           |
4 +---------------------------+---------------------------+
  |        r3 (x=1,y=0)       |        r5 (x=1,y=2)       |
  |            3x5            |            3x5            |
  |                           |                           |
7 +---------------------------+---------------------------+
empty shards:
  r1 (x=0,y=1): 0 cols at col 5
  r4 (x=1,y=1): 0 cols at col 5"""


def test_text_of_an_uneven_2d_layout_lists_the_empty_shards():
    pic = spmd.visualize(UNEVEN, max_width=60)
    assert pic.text == GOLDEN
    assert str(pic) == repr(pic) == GOLDEN
    assert [b.ranks for b in pic.blocks] == [(0,), (2,), (3,), (5,)]
    assert [(b.start, b.stop) for b in pic.blocks] == [
        ((0, 0), (4, 5)), ((0, 5), (4, 10)), ((4, 0), (7, 5)), ((4, 5), (7, 10))]
    assert [(b.ranks, b.start, b.stop) for b in pic.empty] == [
        ((1,), (0, 5), (4, 5)), ((4,), (4, 5), (7, 5))]


def test_text_is_deterministic_and_within_max_width():
    for width in (40, 60, 80, 120):
        a, b = spmd.visualize(UNEVEN, max_width=width), spmd.visualize(UNEVEN, max_width=width)
        assert a.text == b.text
        assert max(len(line) for line in a.text.splitlines()) <= width
        assert all(line == line.rstrip() for line in a.text.splitlines())


def test_a_block_replicated_over_an_axis_lists_all_its_ranks():
    pic = spmd.visualize(Layout((6, 4), P(None, "sp"), Mesh((2, 2), ("dp", "sp"))))
    assert [b.ranks for b in pic.blocks] == [(0, 2), (1, 3)]
    assert [b.label for b in pic.blocks] == ["r0,r2 (dp=*,sp=0)", "r1,r3 (dp=*,sp=1)"]
    assert "r0,r2 (dp=*,sp=0)" in pic.text and "6x2" in pic.text
    # Narrow: the coordinates move to their own line rather than overflow.
    narrow = spmd.visualize(Layout((6, 4), P(None, "sp"), Mesh((2, 2), ("dp", "sp"))),
                            max_width=40)
    assert "|      r0,r2      |      r1,r3      |" in narrow.text
    assert "|   (dp=*,sp=0)   |   (dp=*,sp=1)   |" in narrow.text


def test_a_replicated_tensor_is_one_block_on_every_rank():
    pic = spmd.visualize(Layout((30, 20), None, Mesh(4, "sp")))
    assert [b.ranks for b in pic.blocks] == [(0, 1, 2, 3)]
    assert pic.dims == (0, 1) and "r0-r3" in pic.text and "30x20" in pic.text


def test_one_split_dim_is_drawn_against_the_last_other_dim():
    lay = Layout((2, 3, 30, 32), P(None, None, "sp"), Mesh((2, 4), ("dp", "sp")))
    pic = spmd.visualize(lay)
    assert pic.dims == (2, 3)
    assert pic.text.splitlines()[:3] == [
        "[2, 3, 30, 32] P(None, None, 'sp') over Mesh(dp=2, sp=4)",
        "rows: dim 2 over 'sp' [8, 8, 7, 7]", "cols: dim 3 (not split)"]
    assert [b.size for b in pic.blocks] == [(8, 32), (8, 32), (7, 32), (7, 32)]
    last = spmd.visualize(Layout((4, 12), P(None, "sp"), Mesh(3, "sp")))
    assert last.dims == (0, 1)


def test_placeholder_with_and_without_a_layout():
    lay = Layout((8, 6), P("sp"), Mesh(2, "sp"), sizes={0: [8, 0]})
    ph = Placeholder(torch.Size([8, 6]), torch.float32, "cpu", False, lay, (0,))
    pic = spmd.visualize(ph)
    assert pic.title == "f32[8, 6] P('sp') over Mesh(sp=2)"
    assert "r1: 0 rows at row 8" in pic.text
    whole = spmd.visualize(Placeholder(torch.Size([8, 16]), torch.float64, "cpu", False, None,
                                       (0, 2)))
    assert whole.title == "f64[8, 16] whole on ranks [0, 2]"
    assert [(b.ranks, b.size) for b in whole.blocks] == [((0, 2), (8, 16))]
    one = spmd.visualize(Placeholder(torch.Size([5]), torch.float32, "cpu", False, None, (3,)))
    assert one.title == "f32[5] whole on rank 3" and "r3" in one.text


def test_halo_is_annotated_per_block_and_clipped_at_the_domain_edge():
    pic = spmd.visualize(Layout((30,), P("sp"), Mesh(4, "sp")), halo=(1, 2))
    assert [b.halo for b in pic.blocks] == [((0, 2),), ((1, 2),), ((1, 2),), ((1, 0),)]
    assert [b.halo_start + b.halo_stop for b in pic.blocks] == [
        (0, 10), (7, 18), (15, 25), (22, 30)]
    for s in ("halo +0/+2", "halo +1/+2", "halo +1/+0"):
        assert s in pic.text
    assert pic.text.endswith(
        "halo: elements received before/after along cols, clipped at the domain edge")


def test_halo_reaches_past_an_empty_shard_and_only_named_dims_are_annotated():
    pic = spmd.visualize(UNEVEN, halo={1: 2}, max_width=60)
    assert pic.halo_dims == (1,)
    # r0's right halo comes from r2, past r1's empty shard; rows get no halo.
    assert [b.halo for b in pic.blocks] == [((0, 0), (0, 2)), ((0, 0), (2, 0))] * 2
    assert "r1 (x=0,y=1): 0 cols at col 5, halo +2/+2" in pic.text
    assert "halo +0/+2" in pic.text and "x +0/+2" not in pic.text
    both = spmd.visualize(UNEVEN, halo=1)
    assert both.halo_dims == (0, 1) and "halo +0/+1 x +0/+1" in both.text
    assert "along rows x cols" in both.text


def test_more_than_two_split_dims_needs_dims_and_lists_hidden_ranks():
    lay = Layout((30, 20, 8), P("a", "b", "c"), Mesh((2, 2, 2), ("a", "b", "c")),
                 sizes={2: [8, 0]})
    with pytest.raises(SpecError, match=r"split along 3 dims \[0, 1, 2\].*dims=\(a, b\)"):
        spmd.visualize(lay)
    pic = spmd.visualize(lay, dims=(0, 1))
    assert "not drawn: dim 2 [8, 0]" in pic.text
    assert [b.ranks for b in pic.blocks] == [(0,), (2,), (4,), (6,)]
    assert "r1 (a=0,b=0,c=1): 0 along dim 2" in pic.text
    merged = spmd.visualize(Layout((4, 4, 4), P("a", "b", "c"), Mesh((2, 2, 2), ("a", "b", "c"))),
                            dims=(2,))
    assert [b.ranks for b in merged.blocks] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert "r0,r2,r4,r6 (a=*,b=*,c=0)" in merged.text


def test_many_shards_in_one_dim_are_drawn_downwards():
    pic = spmd.visualize(Layout((64,), P(("a", "b")), Mesh((4, 8), ("a", "b"))))
    assert "rows: dim 0 over ('a', 'b')" in pic.text
    grid = [s for s in pic.text.splitlines() if s.lstrip()[:1] in "+|"]
    assert len(grid) > 32 and max(map(len, grid)) <= 80
    assert "r31 (a=3,b=7)" in pic.text


def test_dims_picks_what_is_drawn():
    pic = spmd.visualize(UNEVEN, dims=1)
    assert pic.dims == (1,)
    assert [b.ranks for b in pic.blocks] == [(0, 3), (2, 5)]
    assert spmd.visualize(UNEVEN, dims=(-1, 0)).dims == (1, 0)
    scalar = spmd.visualize(Layout((), None, Mesh(2, "a")))
    assert scalar.dims == () and "scalar" in scalar.text


@pytest.mark.parametrize("kwargs, err, match", [
    ({"dims": (0, 1, 1)}, SpecError, "one or two dims"),
    ({"dims": (0, 0)}, SpecError, "same dim twice"),
    ({"dims": 2}, SpecError, r"dim 2 is out of range for \[7, 10\]"),
    ({"dims": "0"}, TypeError, "dims must be an int or a sequence of ints"),
    ({"halo": -1}, SpecError, r"halo width \(-1, -1\) must be non-negative"),
    ({"halo": (1, 2, 3)}, TypeError, r"an int or a pair \(lo, hi\)"),
    ({"halo": {5: 1}}, SpecError, "halo names dim 5"),
    ({"halo": {0: 1}, "dims": 1}, SpecError, r"halo names dim 0, which is not drawn"),
    ({"max_width": 0}, TypeError, "max_width must be a positive int"),
])
def test_bad_arguments_are_refused_clearly(kwargs, err, match):
    with pytest.raises(err, match=match):
        spmd.visualize(UNEVEN, **kwargs)


def test_a_tensor_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"got f32\[4\]; for a tensor, pass its layout"):
        spmd.visualize(torch.zeros(4))


def test_importing_and_text_need_no_matplotlib():
    code = ("import sys, spmd; spmd.visualize(spmd.Layout((4,), spmd.P('a'), spmd.Mesh(2, 'a')))"
            ".text; print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- the figure --------------------------------------------------------------------------

@pytest.fixture
def plt():
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    import matplotlib.pyplot as plt
    yield plt
    plt.close("all")


def _rects(ax, gid):
    return [p for p in ax.patches if p.get_gid() == gid]


def test_figure_has_one_rectangle_per_block_with_its_extent_and_label(plt):
    ax = spmd.visualize(UNEVEN).plot()
    blocks = _rects(ax, "block")
    # (x, y) = (col, row) of the top-left corner, rows growing downwards.
    assert [(r.get_x(), r.get_y(), r.get_width(), r.get_height()) for r in blocks] == [
        (0, 0, 5, 4), (5, 0, 5, 4), (0, 4, 5, 3), (5, 4, 5, 3)]
    assert [r.get_label() for r in blocks] == [
        "r0 (x=0,y=0)", "r2 (x=0,y=2)", "r3 (x=1,y=0)", "r5 (x=1,y=2)"]
    assert len({r.get_facecolor() for r in blocks}) == 4
    texts = [t.get_text() for t in ax.texts]
    assert "r0 (x=0,y=0)\n4x5" in texts
    assert any("r1 (x=0,y=1): 0 along dim 1 at 5" in t for t in texts)
    assert list(ax.get_xticks()) == [0, 5, 10] and list(ax.get_yticks()) == [0, 4, 7]
    assert ax.get_ylim() == (7, 0)
    assert ax.get_title() == "[7, 10] P('x', 'y') over Mesh(x=2, y=3)"
    assert _rects(ax, "halo") == []


def test_figure_draws_dashed_halo_outlines_clipped_at_the_edge(plt):
    fig, given = plt.subplots()
    ax = spmd.visualize(UNEVEN, halo=1).plot(ax=given)
    assert ax is given
    halos = _rects(ax, "halo")
    assert len(halos) == 4
    assert all(r.get_linestyle() == "--" and not r.get_fill() for r in halos)
    assert [(r.get_x(), r.get_y(), r.get_width(), r.get_height()) for r in halos] == [
        (0, 0, 6, 5), (4, 0, 6, 5), (0, 3, 6, 4), (4, 3, 6, 4)]
    assert "r0 (x=0,y=0)\n4x5\nhalo +0/+1 x +0/+1" in [t.get_text() for t in ax.texts]


def test_figure_of_one_dim_and_a_replicated_scalar(plt):
    ax = spmd.visualize(Layout((30,), P("sp"), Mesh(4, "sp")), halo=2).plot()
    assert [(r.get_x(), r.get_width()) for r in _rects(ax, "block")] == [
        (0, 8), (8, 8), (16, 7), (23, 7)]
    assert list(ax.get_xticks()) == [0, 8, 16, 23, 30]
    ax = spmd.visualize(Layout((), None, Mesh(2, "a"))).plot()
    assert [r.get_label() for r in _rects(ax, "block")] == ["r0,r1"]
