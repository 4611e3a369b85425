"""The matplotlib figure of a ``LayoutPicture`` (matplotlib is imported only here)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._text import halo_str, size_str

if TYPE_CHECKING:
    from .picture import LayoutPicture


def plot(pic: LayoutPicture, ax: Any = None, *, cmap: str = "tab20",
         fontsize: float | None = None) -> Any:
    try:
        import matplotlib
        from matplotlib.patches import Rectangle
    except ImportError:
        raise ImportError("LayoutPicture.plot needs matplotlib: pip install matplotlib; "
                          "print(picture) shows the same picture as text") from None
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(7, 5) if len(pic.dims) == 2 else (8, 2.4),
                             layout="constrained")
    colours = matplotlib.colormaps[cmap]
    n = getattr(colours, "N", 20)
    # 2-d: rows down, cols across; one drawn dim: across; none: one unit square.
    def rect(start, stop):
        if len(pic.dims) == 2:
            return start[1], start[0], stop[1] - start[1], stop[0] - start[0]
        if len(pic.dims) == 1:
            return start[0], 0, stop[0] - start[0], 1
        return 0, 0, 1, 1
    show = tuple(i for i, d in enumerate(pic.dims) if d in pic.halo_dims)
    if fontsize is None:
        fontsize = 10 if len(pic.blocks) <= 16 else 8 if len(pic.blocks) <= 64 else 6
    for k, b in enumerate(pic.blocks):
        # tab20 comes in (dark, light) pairs: fill light, outline the halo dark.
        dark, light = ((colours(2 * k % n), colours((2 * k + 1) % n)) if n == 20
                       else (colours(k % n),) * 2)
        x, y, w, h = rect(b.start, b.stop)
        ax.add_patch(Rectangle((x, y), w, h, facecolor=light, edgecolor="black", linewidth=1.2,
                               gid="block", label=b.label))
        text = f"{b.label}\n{size_str(b)}" + (f"\n{halo_str(b, show)}" if show else "")
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize,
                wrap=True)
        if show:
            hx, hy, hw, hh = rect(b.halo_start, b.halo_stop)
            ax.add_patch(Rectangle((hx, hy), hw, hh, fill=False, edgecolor=dark, linestyle="--",
                                   linewidth=1.6, gid="halo", label=f"halo of {b.label}"))
    _axes(ax, pic)
    if pic.empty:
        lines = ["empty shards:"] + [f"{b.label}: {_where(b, pic)}" for b in pic.empty]
        ax.text(0.0, -0.03, "\n".join(lines), transform=ax.transAxes, ha="left", va="top",
                fontsize=fontsize, color="dimgray")
    return ax


def _where(b, pic) -> str:
    out = [f"0 along dim {d} at {b.start[i]}" for i, d in enumerate(pic.dims)
           if b.start[i] == b.stop[i]]
    return ", ".join(out) or "0 along " + ", ".join(
        f"dim {d}" for d, n in enumerate(b.local_shape) if n == 0)


def _axes(ax: Any, pic: LayoutPicture) -> None:
    """Ticks at the shard boundaries (global indices); rows grow downwards, as printed."""
    def bounds(i):
        return sorted({v for b in pic.blocks + pic.empty for v in (b.start[i], b.stop[i])}
                      | {0, pic.shape[pic.dims[i]]})
    nd = len(pic.dims)
    if nd >= 1:
        xs = bounds(nd - 1)
        ax.set_xlim(xs[0], xs[-1])
        ax.set_xticks(xs)
        ax.set_xlabel(f"dim {pic.dims[-1]}")
    else:
        ax.set_xlim(0, 1)
        ax.set_xticks([])
    if nd == 2:
        ys = bounds(0)
        ax.set_ylim(ys[-1], ys[0])
        ax.set_yticks(ys)
        ax.set_ylabel(f"dim {pic.dims[0]}")
    else:
        ax.set_ylim(1, 0)
        ax.set_yticks([])
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    ax.tick_params(labelsize=8)
    ax.set_title(pic.title, fontsize=11)
    ax.margins(0)
    for s in ax.spines.values():
        s.set_visible(False)
