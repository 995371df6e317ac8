"""Figure output for every command that draws: pyplot on the file-only Agg backend and PNG bytes."""
from __future__ import annotations

import io
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on servers), imported late:
    commands that draw nothing do not pay for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def to_png(fig, dpi: int = 72) -> bytes:
    """A figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    pyplot().close(fig)
    return buf.getvalue()


def save_png(fig, path: str | Path, dpi: int = 72) -> Path:
    """Write a figure as a PNG file (through to_png); the figure is closed."""
    path = Path(path)
    path.write_bytes(to_png(fig, dpi))
    return path
