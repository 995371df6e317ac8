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


NODE_GPUS = 8  # the GPU recipe's node (README): a card's batch is the global batch over its 8 cards


def card_batch(cfg) -> int:
    """The volumes one card takes per micro-step in the GPU recipe (`global_batch` over a node of
    NODE_GPUS, train/batching.py): what a single-card measurement of the production step runs."""
    from train import batching

    return batching.split(cfg.global_batch, cfg.chip_batch, NODE_GPUS, NODE_GPUS).per_chip
