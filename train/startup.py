"""Where a pretraining run's first seconds go before its steady steps: one `startup` record in
metrics.jsonl and one printed line. The first H200 runs spent 92-97 s before their first step, the
loader's workers starting one after another (docs/accelerators.md)."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm


class Startup:
    """Laps from the loop's start (the loader, whose workers start there, the resident volumes, the
    step-0 online probe), then the first step's wait for its batches and its update (kernel
    loading, selection or compilation), and when each loader worker was forked and ready."""

    def __init__(self, log, show: bool):
        self.log, self.show = log, show
        self.t = time.perf_counter()
        self.laps: dict[str, float] = {}
        self.pending = True
        # removed with this object or at the report; a worker ready later finds no file and writes nothing
        self._dir = tempfile.TemporaryDirectory(prefix="octfm-startup-", ignore_cleanup_errors=True)
        self.worker_log = str(Path(self._dir.name) / "workers.jsonl")
        Path(self.worker_log).touch()  # the workers append to it, never create it (data.note_worker_start)
        self.wall = time.time()  # the loader's workers date their start in wall-clock time

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[f"{name}_s"] = round(now - self.t, 3)
        self.t = now

    def after_step(self, step: int, loss, fetch_s: float) -> None:
        """Called after every step; after the first only: its wait for its batches (`fetch_s`) and
        the rest of it become the last two laps, and the record is written. Reads `loss` to the
        host, so the first update's time is its own and not the next step's."""
        if not self.pending:
            return
        float(loss)
        since = time.perf_counter() - self.t
        self.laps["first_batch_s"] = round(fetch_s, 3)
        self.laps["first_update_s"] = round(since - fetch_s, 3)
        self.report(step)

    def workers(self) -> dict:
        """When the loader's workers were forked and became ready (imports and the dataset's
        unpickling done), seconds after the loop began: the last fork, the first and the last
        ready among those ready by now (process start times to the kernel's clock tick, 1/100 s)."""
        recs = [json.loads(line) for line in Path(self.worker_log).read_text().splitlines()]
        if not recs:  # no worker processes (data.workers: 0), or none ready yet
            return {}
        ready = sorted(r["ready"] - self.wall for r in recs)
        return {"workers_ready": len(recs), "workers_last_forked_at": round(max(r["forked"] for r in recs) - self.wall, 3),
                "workers_first_ready_at": round(ready[0], 3), "workers_last_ready_at": round(ready[-1], 3)}

    def report(self, step: int) -> None:
        self.pending = False
        workers = self.workers()
        self.log.log({"step": step, **self.laps, "total_s": round(sum(self.laps.values()), 3), **workers},
                     prefix="startup")
        self._dir.cleanup()
        if self.show:
            parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in self.laps.items())
            more = (f"; {workers['workers_ready']} loader workers ready by then, forked by "
                    f"{workers['workers_last_forked_at']:.1f} s, ready from {workers['workers_first_ready_at']:.1f} to "
                    f"{workers['workers_last_ready_at']:.1f} s") if workers else ""
            tqdm.write(f"pretrain: started in {sum(self.laps.values()):.1f} s ({parts}){more}", file=sys.stderr)
