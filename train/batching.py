"""The global batch over chips, processes and accumulation steps: one recipe on every machine.

A config states `global_batch` (volumes per optimizer step). On W processes feeding C chips in
all (CUDA and CPU: one process per chip; XLA SPMD: one process per host feeding its chips), a
step is `accum` micro-steps of `per_process` volumes on every process, `per_chip` on every chip:
global_batch = per_chip x C x accum. `accum` is the fewest micro-steps whose per-chip batch is at
most `chip_batch` (`make plan`'s largest batch that fits; None: no cap, one pass). The trainer
and `make plan` read the same split; a global batch the chips cannot split evenly is refused
with the numbers.
"""
from __future__ import annotations

import dataclasses

from octfm.config import FieldError


@dataclasses.dataclass(frozen=True)
class Split:
    global_batch: int   # volumes per optimizer step
    chips: int          # accelerators (CPU: processes) in the run
    processes: int      # data-loading processes (CUDA and CPU: one per chip; XLA SPMD: one per host)
    hosts: int          # machines, each with its own page cache (train/shares.py)
    accum: int          # micro-steps per optimizer step (gradient accumulation)
    per_chip: int       # volumes a chip takes per micro-step
    per_process: int    # volumes a process loads per micro-step

    @property
    def per_host(self) -> int:
        """Volumes a host reads per optimizer step: its share of the global batch."""
        return self.global_batch // self.hosts

    def describe(self, tokens: int | None = None) -> str:
        """One line for the start line and `make plan`."""
        s = (f"global batch {self.global_batch} = {self.per_chip} a chip x {self.chips} chip(s) x {self.accum} "
             f"accumulation step(s) ({self.per_process} a process per micro-step, {self.processes} process(es) on "
             f"{self.hosts} host(s))")
        if tokens is not None:
            s += f"; {self.global_batch * tokens:,} tokens per step"
        return s


def split(global_batch: int, chip_batch: int | None, chips: int, processes: int, hosts: int = 1) -> Split:
    """The split of `global_batch` on `chips` chips fed by `processes` processes on `hosts` hosts,
    with at most `chip_batch` volumes a chip per micro-step (None: the whole share at once).
    Refuses (FieldError on global_batch or chip_batch) a batch the chips or hosts cannot split."""
    if chips < 1 or processes < 1 or hosts < 1 or chips % processes or processes % hosts:
        raise ValueError(f"chips {chips}, processes {processes}, hosts {hosts}: each must divide the one before")
    if global_batch % chips:
        raise FieldError("global_batch", f"{global_batch} does not divide over {chips} chip(s) ({processes} "
                                          f"process(es) on {hosts} host(s)): use a multiple of {chips}, e.g. "
                                          f"{max(chips, global_batch // chips * chips)}")
    share = global_batch // chips  # volumes a chip takes per optimizer step
    cap = share if chip_batch is None else chip_batch
    accum = next((a for a in range(1, share + 1) if share % a == 0 and share // a <= cap), None)
    if accum is None:  # only when cap < 1, which the config refuses
        raise FieldError("chip_batch", f"{chip_batch}: needs at least 1")
    per_chip = share // accum
    return Split(global_batch, chips, processes, hosts, accum, per_chip, per_chip * (chips // processes))
