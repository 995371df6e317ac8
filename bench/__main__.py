"""Run the benchmark suites and write runs/bench/bench.json and bench.md.

Suites merge into the existing bench.json, so `--only cache` refreshes one section.
`--readme` also replaces each measured suite's block in docs/benchmarks.md (between
`<!-- bench:<suite> -->` and `<!-- /bench:<suite> -->`), so the documented numbers come from a run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback
from pathlib import Path

from bench import (augment_bench, cache_bench, learning_bench, probe_bench, recipe_bench, reference_bench, replace_block,
                   scale_bench, train_bench, xla_bench)
from octfm import cli

SUITES = {"cache": cache_bench.run, "scale": scale_bench.run, "train": train_bench.run, "reference": reference_bench.run,
          "recipe": recipe_bench.run, "augment": augment_bench.run, "xla": xla_bench.run, "learning": learning_bench.run,
          "probes": probe_bench.run}
BLOCKS_PAGE = Path("docs/benchmarks.md")  # where --readme writes each suite's table (its bench:<suite> block)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="make bench")
    ap.add_argument("--out", default="runs/bench")
    ap.add_argument("--only", choices=sorted(SUITES), action="append")
    ap.add_argument("--quick", action="store_true", help="smaller inputs (a smoke run, not for the record)")
    ap.add_argument("--xla-python", default=None, help="python of the torch_xla venv (make xla-venv)")
    ap.add_argument("--readme", action="store_true",
                    help="write the measured suites into docs/benchmarks.md's bench blocks")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["machine"] = {"cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                          "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    for name in a.only or list(SUITES):
        kw = {"xla_python": a.xla_python} if name == "xla" else {}
        try:
            res, lines = SUITES[name](out / name, quick=a.quick, **kw)
        except Exception as exc:  # one suite's failure is reported and the others still run
            traceback.print_exc()
            res, lines = {"error": repr(exc)}, [f"## {name}", "", f"Verdict: not measured: the suite failed ({exc!r})."]
        results[name] = {**res, "markdown": lines, "quick": a.quick}
    md = [f"# octfm benchmarks ({results['machine']['cpus']} CPUs, {results['machine']['when']})", ""]
    for name in SUITES:  # every suite measured so far, newest numbers
        if name in results:
            md += results[name]["markdown"] + [""]
    path.write_text(json.dumps(results, indent=2))
    (out / "bench.md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"bench: wrote {path} and {out / 'bench.md'}")
    if a.readme:
        done = [name for name in a.only or list(SUITES)  # a failed suite leaves the page's last measurement
                if "error" not in results[name] and update_blocks(BLOCKS_PAGE, name, results[name]["markdown"])]
        print(f"bench: {BLOCKS_PAGE} blocks replaced: {', '.join(done) or 'none (no <!-- bench:<suite> --> markers)'}")
    return 0


def update_blocks(page: Path, suite: str, lines: list[str]) -> bool:
    """Replace the text between this suite's markers in `page`, its headings one level under the page's;
    False when it has none."""
    body = [ln.replace("## ", "#### ", 1) if ln.startswith("## ") else ln.replace("### ", "#### ", 1)
            if ln.startswith("### ") else ln for ln in lines]
    return replace_block(page, f"<!-- bench:{suite} -->", f"<!-- /bench:{suite} -->", body)


if __name__ == "__main__":
    cli.run(main)
