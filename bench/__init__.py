"""`make bench`: performance claims measured as ratios, side by side, in one run."""


def verdict(ok: bool) -> str:
    """How every benchmark's verdict line ends on its target."""
    return "met" if ok else "NOT met"
