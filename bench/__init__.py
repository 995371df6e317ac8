"""`make bench`: performance claims measured as ratios, side by side, in one run."""
from __future__ import annotations

from pathlib import Path


def verdict(ok: bool) -> str:
    """How every benchmark's verdict line ends on its target."""
    return "met" if ok else "NOT met"


def replace_block(page: Path, begin: str, end: str, lines: list[str]) -> bool:
    """Replace the text between the markers `begin` and `end` in `page` with `lines` (the markers stay);
    False, and the page untouched, when it lacks either. Generated tables live between such markers."""
    text = page.read_text()
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    page.write_text(head + begin + "\n" + "".join(f"{ln}\n" for ln in lines) + end + tail)
    return True
