"""The text rendering of a ``LayoutPicture``: ASCII boxes proportional to shard sizes."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .picture import Block

PAD = 2  # columns of space around a label inside its box


def render(title: str, dim_notes: Sequence[str], extra: str, blocks: Sequence[Block],
           empty: Sequence[Block], show: tuple[int, ...], max_width: int) -> str:
    """The whole text. ``show``: positions (in the drawn dims) whose halo is annotated.

    One drawn dim is a horizontal strip, or a vertical one where the strip would not fit
    ``max_width``; two dims are rows and columns.
    """
    options = {0: [(None, None)], 1: [(None, 0), (0, None)], 2: [(0, 1)]}[len(dim_notes)]
    grid: list[str] = ["(no rank holds data)"]
    for ri, ci in options:
        if blocks:
            grid = _grid(blocks, ri, ci, show, max_width)
        if max(map(len, grid)) <= max_width:
            break
    names = {i: n for i, n in ((ri, "rows"), (ci, "cols")) if i is not None}
    lines = [title] + [f"{names[i]}: {n}" for i, n in enumerate(dim_notes)]
    lines += ([extra] if extra else []) + grid
    if empty:
        lines.append("empty shards:")
        lines += [f"  {b.label}: {_empty_what(b, names, show)}" for b in empty]
    if show:
        along = " x ".join(names[i] for i in show)
        lines.append(f"halo: elements received before/after along {along}, clipped at the "
                     f"domain edge")
    return "\n".join(line.rstrip() for line in lines)


def size_str(b: Block) -> str:
    return "x".join(str(s) for s in b.size) if b.size else "scalar"


def halo_str(b: Block, show: tuple[int, ...]) -> str:
    """``halo +0/+1`` for the drawn dims (positions) in ``show``, joined by `` x ``."""
    return "halo " + " x ".join(f"+{b.halo[i][0]}/+{b.halo[i][1]}" for i in show)


def _empty_what(b: Block, names: dict[int, str], show: tuple[int, ...]) -> str:
    out = [f"0 {names[i]} at {names[i][:-1]} {b.start[i]}"
           for i in names if b.start[i] == b.stop[i]]
    if not out:  # empty along a split dim that is not drawn
        out = [f"0 along dim {d}" for d, n in enumerate(b.local_shape) if n == 0]
    return " and ".join(out) + (f", {halo_str(b, show)}" if show else "")


def _grid(blocks: Sequence[Block], ri: int | None, ci: int | None, show: tuple[int, ...],
          max_width: int) -> list[str]:
    """Boxes for the blocks: block dim ``ri`` down the rows, ``ci`` across (None: one)."""
    def iv(b: Block, i: int | None) -> tuple[int, int] | None:
        return None if i is None else (b.start[i], b.stop[i])
    rows = sorted({iv(b, ri) for b in blocks}, key=lambda v: v or (0, 0))
    cols = sorted({iv(b, ci) for b in blocks}, key=lambda v: v or (0, 0))
    cell = {(iv(b, ri), iv(b, ci)): _parts(b, show) for b in blocks}
    row_ticks = [str(r[0]) for r in rows] + [str(rows[-1][1])] if ri is not None else []
    margin = max(map(len, row_ticks)) + 1 if row_ticks else 0
    room = max_width - margin - len(cols) - 1

    for level in range(4):  # the least broken-up labels that fit
        need = [max(_min_width(cell[r, c], level) for r in rows) + PAD for c in cols]
        if sum(need) <= room:
            break
    widths = _allocate([1 if c is None else c[1] - c[0] for c in cols], need, room)
    labels = {(r, c): _lines(p, level, widths[cols.index(c)] - PAD) for (r, c), p in cell.items()}
    need_h = [max(len(labels[r, c]) for c in cols) for r in rows]
    if len(rows) > 1:  # terminal cells are twice as tall as wide: a modest height budget
        heights = _allocate([r[1] - r[0] for r in rows], need_h, max(sum(need_h), max_width // 8))
    else:  # one strip: a blank line above and below the labels
        heights = [need_h[0] + 2]

    border = "+" + "+".join("-" * w for w in widths) + "+"
    out = [" " * margin + _col_ticks(cols, widths)] if ci is not None else []
    for i, r in enumerate(rows):
        out.append((row_ticks[i].rjust(margin - 1) + " " if margin else "") + border)
        for j in range(heights[i]):
            line = "|"
            for c, w in zip(cols, widths):
                lab = labels[r, c]
                k = j - (heights[i] - len(lab)) // 2
                line += (lab[k] if 0 <= k < len(lab) else "").center(w) + "|"
            out.append(" " * margin + line)
    out.append((row_ticks[-1].rjust(margin - 1) + " " if margin else "") + border)
    return out


def _parts(b: Block, show: tuple[int, ...]) -> list[str]:
    """``[ranks, coordinates, size, halo]``, the last three possibly empty."""
    ranks, _, coords = b.label.partition(" ")
    return [ranks, coords, size_str(b), halo_str(b, show) if show else ""]


def _min_width(parts: list[str], level: int) -> int:
    # width 0 puts every token of a broken rank list on its own line: the narrowest
    return max(len(t) for t in _lines(parts, level, 0))


def _lines(parts: list[str], level: int, width: int) -> list[str]:
    """A block's label, one part per line: level 0 ``r1 (x=0,y=1)`` whole; level 1 the
    coordinates on their own line; level 2 long rank lists broken at commas; level 3
    without the coordinates."""
    ranks, coords, *rest = parts
    if level == 0:
        first = [f"{ranks} {coords}" if coords else ranks]
    elif level == 1:
        first = [ranks, coords]
    else:
        first = _pack([t + "," for t in ranks.split(",")[:-1]] + [ranks.split(",")[-1]], width)
        first += [coords] if level == 2 else []
    return [t for t in first + rest if t]


def _pack(tokens: list[str], width: int) -> list[str]:
    """Greedy: as many tokens per line as fit."""
    lines: list[str] = []
    for t in tokens:
        if lines and len(lines[-1]) + len(t) <= width:
            lines[-1] += t
        else:
            lines.append(t)
    return lines


def _allocate(sizes: Sequence[int], mins: Sequence[int], total: int) -> list[int]:
    """Integers proportional to ``sizes``, each at least its ``min``, adding up to at most
    ``total`` (more only where the minimums alone do)."""
    def fit(s: float) -> list[int]:
        return [max(m, int(z * s + 0.5)) for z, m in zip(sizes, mins)]
    if sum(mins) >= total:
        return list(mins)
    lo, hi = 0.0, float(total) / min(sizes)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(fit(mid)) <= total else (lo, mid)
    return fit(lo)


def _col_ticks(cols: list, widths: list[int]) -> str:
    """Global indices at the column borders; middle ones that would collide are left out."""
    if cols[0] is None:
        return ""
    pos = [0]
    for w in widths:
        pos.append(pos[-1] + w + 1)
    vals = [str(c[0]) for c in cols] + [str(cols[-1][1])]
    line = [" "] * (pos[-1] + 1)
    last = vals[-1]
    end = pos[-1] + 1 - len(last)
    line[end:] = last
    free = 0
    for p, v in zip(pos[:-1], vals[:-1]):
        if p >= free and p + len(v) < end:
            line[p:p + len(v)] = v
            free = p + len(v) + 1
    return "".join(line)
