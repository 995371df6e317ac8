"""`make results RESULT=<run>/<cue>/result.json [SIZE=cpu|gpu]`: README's Results table, from runs.

A learning check's result.json becomes one record in docs/results.jsonl (one JSON object a line,
committed: a curated record, like docs/test-times.csv, not a run output), replacing the record of the
same check (cue, size, cohort, overrides) if there is one; README's block between `<!-- results -->`
and `<!-- /results -->` is then rewritten from every record, one short line each. With no RESULT it
only rewrites the block. The record keeps the headline (diabetic, pretrained minus random init, both
encoders through the head kind chosen for the pair, with the paired 95% interval), each question's
verdict (learns, label efficiency, fine-tuning), the stages' wall time, the commit and the date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path
from typing import Sequence

from bench import replace_block
from check.cohort import BINARY
from check.verdicts import headline_row
from octfm import cli

RECORDS = Path("docs/results.jsonl")
README = Path("README.md")
BEGIN, END = "<!-- results -->", "<!-- /results -->"
QUESTIONS = ("learns", "label_efficiency", "finetune")
KEY = ("cue", "size", "cohort", "overrides")  # one record per check: a re-run replaces it
HEADER = ["| cue | size | cohort | diabetic: pretrained - random init [95% CI] | learns | label efficiency | "
          "fine-tuning | wall | commit, date |", "|---|---|---|---|---|---|---|---|---|"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make results", description=__doc__)
    ap.add_argument("result", nargs="?", help="a learning check's result.json (RESULT=); none: rewrite the table only")
    ap.add_argument("--records", type=Path, default=RECORDS)
    ap.add_argument("--readme", type=Path, default=README)
    a = ap.parse_args(argv)
    records = read_records(a.records)
    if a.result:
        path = Path(a.result)
        rec = record(json.loads(path.read_text()), date=datetime.date.fromtimestamp(path.stat().st_mtime).isoformat())
        records = upsert(records, rec)
        a.records.write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"results: {a.records}: {row(rec)}")
    if not replace_block(a.readme, BEGIN, END, results_rows(records)):
        raise cli.UsageError(f"{a.readme} has no {BEGIN} ... {END} block to write the table into")
    print(f"results: {a.readme}'s table rewritten from {len(records)} record(s)")
    return 0


def record(result: dict, date: str = "") -> dict:
    """One run's record: what identifies the check, its headline, each question's verdict, its wall time,
    the commit it ran at."""
    if "size" not in result or "commit" not in result:
        raise cli.UsageError(f"a result.json without its size and commit: written before the v1 cut (its rows are "
                             f"docs/results.md's, which reproduce from the tags it names)")
    b = headline_row(result["tasks"][BINARY])
    return {"cue": result["cue"], "size": result["size"],
            "cohort": result["cohort_seed"] if result.get("cohort_seed") is not None else result.get("source"),
            "overrides": list(result.get("overrides", [])),
            "headline": {"task": BINARY, "head": b["pretrained_head"], "difference": round(b["difference"], 3),
                         "ci95": [None if v is None else round(v, 3) for v in b["difference_ci95"]],
                         "pretrained": round(b["pretrained"], 3), "random_init": round(b["random_init"], 3),
                         "random_draws": result.get("random_draws", 1)},
            "verdicts": {q: outcome(line) for q, line in asked_verdicts(result).items()},
            "wall_s": wall_s(result.get("stages", {})), "commit": result["commit"], "date": date}


def asked_verdicts(result: dict) -> dict:
    """Each asked question's verdict line (check/verdicts.py keeps them where the check writes them)."""
    tuned = result.get("finetune") or {}
    lines = {"learns": result["verdict"], "label_efficiency": (result.get("label_efficiency") or {}).get("verdict"),
             "finetune": tuned.get("verdict")}
    return {q: line for q, line in lines.items() if line}


def outcome(line: str) -> str:
    """A verdict line's outcome: its first PASS, FAIL or NOT READ."""
    m = re.search(r"\b(PASS|FAIL|NOT READ)\b", line)
    return m.group(1) if m else "?"


def wall_s(stages: dict) -> float:
    """The check's wall time: its stages one after another (a stage run with others, inside a group, counts
    in the group's time)."""
    return round(sum(s["wall_s"] for s in stages.values() if "together" not in s), 1)


def upsert(records: list[dict], rec: dict) -> list[dict]:
    """`records` with `rec` in place of the record of the same check, or added at the end."""
    same = [i for i, r in enumerate(records) if all(r.get(k) == rec[k] for k in KEY)]
    if same:
        return [rec if i == same[0] else r for i, r in enumerate(records) if i not in same[1:]]
    return [*records, rec]


def read_records(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def results_rows(records: list[dict]) -> list[str]:
    if not records:
        return ["No run recorded since the cut yet: `make results RESULT=<run>/<cue>/result.json` adds one."]
    return [*HEADER, *(row(r) for r in records)]


def row(r: dict) -> str:
    h = r["headline"]
    lo, hi = (("n/a" if v is None else f"{v:+.3f}") for v in h["ci95"])
    cohort = f"seed {r['cohort']}" if isinstance(r["cohort"], int) else f"`{r['cohort']}`"
    if r["overrides"]:
        cohort += f", `{' '.join(r['overrides'])}`"
    said = [r["verdicts"].get(q, "-") for q in QUESTIONS]
    return (f"| {r['cue']} | {r['size']} | {cohort} | {h['difference']:+.3f} [{lo}, {hi}] ({h['head']}) | "
            f"{' | '.join(said)} | {minutes(r['wall_s'])} | {r['commit'] or '-'}, {r['date'] or '-'} |")


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s"


if __name__ == "__main__":
    cli.run(main)
