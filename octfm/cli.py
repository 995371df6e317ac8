"""Exit codes and the common wrapper every stage entry runs under.

Contract (docs/architecture.md, "Exit codes"): 0 finished (failed rows allowed), 3 with STRICT when rows failed,
2 usage or config error, 1 anything else.
"""
from __future__ import annotations

import math
import sys
import traceback
from typing import Callable, Sequence

from octfm.errors import DataError, SetupError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_STRICT = 3


class UsageError(Exception):
    """A bad argument, config key or input table: the message names the file and the key."""


class JobAborted(Exception):
    """The environment failed under a batch job (store unreachable, disk full): the job stopped
    early, kept what it finished, and says how to continue. Exit status 1, no traceback."""


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> None:
    """Run a stage entry and turn its outcome into the documented exit status."""
    try:
        code = main(argv)
    except (UsageError, DataError, SetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except JobAborted as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001 - the top level reports everything else as status 1
        traceback.print_exc()
        code = EXIT_ERROR
    sys.exit(code)


def strict_status(n_failed: int, strict: bool) -> int:
    """Status for a batch job that finished: 3 only when STRICT asked for it and rows failed."""
    return EXIT_STRICT if (strict and n_failed) else EXIT_OK


def report_verification(cmd: str, problems: list[str], verified: str) -> int:
    """End-of-command verification summary shared by the copy commands: status 1 on failure."""
    if problems:
        for p in problems[:20]:
            print(f"verify: {p}")
        print(f"{cmd}: verification FAILED for {len(problems)} file(s)")
        return EXIT_ERROR
    print(f"{cmd}: verified {verified}")
    return EXIT_OK


def reason(error: str | None) -> str:
    """The category of a failure message: the text before its first ':' (every stage writes
    `<category>: <detail>`), so summaries can count failures by kind."""
    return (error or "").split(":", 1)[0].strip()


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width text table for end-of-command summaries."""
    cells = [[str(h) for h in header]] + [[("" if v is None else str(v)) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_ci(ci) -> str:
    """`[lo, hi]` of a 95% interval to 3 decimals; empty when there is none."""
    if not ci or ci[0] is None:
        return ""
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def fmt_number(v, ci=None, spec: str = ".3f") -> str:
    """A score for summaries and reports: `n/a` when missing or not finite, else `v` in `spec`,
    followed by its interval when one is given (`0.512 [0.401, 0.630]`)."""
    if v is None or not math.isfinite(float(v)):
        return "n/a"
    interval = fmt_ci(ci)
    return format(v, spec) + (f" {interval}" if interval else "")
