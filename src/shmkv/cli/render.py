"""Rendering: colour (``paint``, on only for a terminal or --color always), aligned
``table``s, number/time formatting, JSON output, the state styles shared by several
commands, and the PNG pool map (``draw_png``, which needs Pillow: the ``cli`` extra)."""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import sys
import time

import numpy as np

from ..config import CacheConfig
from .common import CACHED, DEAD, FREE, OWNED, SHARED, CLIError

_STYLES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33",
           "blue": "34", "magenta": "35", "cyan": "36", "bold red": "1;31"}


_color = False          # set once per run by set_color(); read by paint() and color_on()


def set_color(on):
    """Turn colour on or off for this run (``main`` decides from --color and the terminal)."""
    global _color
    _color = bool(on)


def color_on():
    return _color


def paint(text, style):
    """`text` in `style` when colour is on (a terminal, or --color always)."""
    if not _color or not style:
        return str(text)
    return f"\x1b[{_STYLES[style]}m{text}\x1b[0m"


def _cell(c):
    return c if isinstance(c, tuple) else (str(c), None)


def table(headers, rows, align="", indent=""):
    """Aligned columns.  A cell is a value or (text, style); `align` has one 'l' or 'r'
    per column (default: left)."""
    rows = [[_cell(c) for c in r] for r in rows]
    n = len(headers)
    widths = [len(h) for h in headers]
    for r in rows:
        for i, (t, _) in enumerate(r):
            widths[i] = max(widths[i], len(t))
    align = (align + "l" * n)[:n]

    def fmt(cells, header=False):
        out = []
        for i, (t, style) in enumerate(cells):
            pad = widths[i] - len(t)
            if i == n - 1 and align[i] == "l":
                pad = 0                     # no trailing blanks
            text = (" " * pad + t) if align[i] == "r" else (t + " " * pad)
            out.append(paint(text, "bold" if header else style))
        return indent + "  ".join(out)

    lines = [fmt([(h, None) for h in headers], header=True)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def fmt_bytes(n):
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def fmt_pct(x):
    return f"{100.0 * x:.1f}%"


def fmt_time_ns(ns):
    if not ns:
        return "-"
    try:
        return _dt.datetime.fromtimestamp(ns / 1e9).astimezone().isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns"


def fmt_age(ns):
    if not ns:
        return "-"
    s = time.time() - ns / 1e9
    if s < 0:
        return "0s"
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def fmt_duration(s):
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def emit_json(doc):
    sys.stdout.write(json.dumps(doc, indent=2, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, CacheConfig):
        return dataclasses.asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


STATE_STYLE = {"ok": "green", "stale": "yellow", "corrupt": "bold red",
                "incompatible": "magenta", "not-ready": "yellow", "not-shmkv": "dim",
                "unreadable": "red"}


def owner_cell(s):
    if s["owner"] == "dead":
        return ("DEAD", "bold red")
    if s["owner"] == "detached":
        return ("detached", "cyan")
    return ("alive", "green")


_PNG_COLORS = {FREE: (230, 230, 230), CACHED: (158, 202, 225), OWNED: (49, 163, 84),
               SHARED: (253, 141, 60), DEAD: (214, 39, 40)}


_PNG_LABELS = {FREE: "free", CACHED: "cached (refcount 0, prefix-reusable)",
               OWNED: "owned (refcount 1)", SHARED: "shared (refcount > 1)",
               DEAD: "held only by dead processes"}


def draw_png(path, name, view):
    """One cell per block (or per group of blocks in huge pools: the most severe state of
    the group), coloured by state, with a title and a legend."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise CLIError('--png needs Pillow, which is not installed: pip install "shmkv[cli]" '
                       "(or pip install Pillow)") from None
    state = view["state"]
    nb = len(state)
    group = max(1, math.ceil(nb / (1 << 20)))
    if group > 1:
        pad = (-nb) % group
        state = np.concatenate([state, np.zeros(pad, np.int8)]).reshape(-1, group).max(axis=1)
    cells = len(state)
    cols = max(1, min(cells, 64 if cells <= 4096 else math.ceil(math.sqrt(cells * 2))))
    rows = math.ceil(cells / cols)
    cell = max(1, min(24, 1200 // cols, 900 // max(rows, 1)))
    gap = 1 if cell >= 6 else 0
    grid = np.full(rows * cols, 255, dtype=np.int16)   # 255: past the last block
    grid[:cells] = state
    rgb = np.full((rows * cols, 3), 255, dtype=np.uint8)
    for st, col in _PNG_COLORS.items():
        rgb[grid == st] = col
    img_grid = rgb.reshape(rows, cols, 3).repeat(cell, axis=0).repeat(cell, axis=1)
    if gap:
        img_grid[cell - 1::cell, :, :] = 255
        img_grid[:, cell - 1::cell, :] = 255
    try:
        font = ImageFont.load_default(size=14)
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    margin, title_h, line_h = 12, 44, 20
    legend_h = line_h * len(_PNG_COLORS) + 8
    gw, gh = img_grid.shape[1], img_grid.shape[0]
    width = max(gw + 2 * margin, 520)
    height = title_h + gh + legend_h + 2 * margin
    img = Image.new("RGB", (width, height), (255, 255, 255))
    img.paste(Image.fromarray(img_grid, "RGB"), (margin, title_h))
    d = ImageDraw.Draw(img)
    b = view["blocks"]
    d.text((margin, 6), f"shmkv {name}: {nb} blocks x {b['block_size']} tokens", fill=(0, 0, 0),
           font=font)
    per = f"1 cell = {group} blocks (the most severe state)" if group > 1 else "1 cell = 1 block"
    counts = {st: int((view["state"] == st).sum()) for st in _PNG_COLORS}
    d.text((margin, 24), f"used {b['used']} ({fmt_pct(b['used'] / nb)}) = owned "
           f"{counts[OWNED]} + shared {counts[SHARED]} + dead {counts[DEAD]};  {per}",
           fill=(60, 60, 60), font=font)
    y = title_h + gh + margin
    for st, col in _PNG_COLORS.items():
        d.rectangle([margin, y + 2, margin + 14, y + 16], fill=col, outline=(90, 90, 90))
        d.text((margin + 22, y + 1), f"{_PNG_LABELS[st]}: {counts[st]}", fill=(0, 0, 0),
               font=font)
        y += line_h
    try:
        img.save(path, format="PNG")
    except OSError as e:
        raise CLIError(f"cannot write {path}: {e.strerror or e}") from None
