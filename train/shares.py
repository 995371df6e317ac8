"""Each host reads its own share of the training volumes.

A host is a set of processes that share one page cache: a torchrun node (LOCAL_WORLD_SIZE
processes; GROUP_RANK is its number) or one XLA SPMD process (one per TPU VM host). The training
rows are dealt to the hosts once, balanced by bytes (within each device, largest first, in a
snake order: 0, 1, ..., n-1, n-1, ..., 0, ...); every epoch each host shuffles its own share and
deals it to its processes. So after the first epoch a host's page cache can hold its share
instead of the whole cache, and `make stage HOST=i HOSTS=n` copies one share (host_reads: what
else every host reads, validation's rows and the online probe's). With one host the order is the
single permutation of the whole set that training always drew. Which sample a step sees depends
only on the seed, the epoch and the hosts, never on loader workers or processes per host (the
per-sample randomness is keyed by (seed, epoch, index): train/data.py).
"""
from __future__ import annotations

import posixpath
from collections import defaultdict

from octfm import fsio
from octfm.errors import DataError
from train import data
from train.data import EpochStream, epoch_permutation


def volume_bytes(files: dict[str, int], volumes) -> dict[str, int]:
    """Bytes on disk of each volume (a Zarr folder relative to the cache root) from a listing of
    the cache ({relative path: size}, as fsio.list_tree or rclone gives it); a volume with no file
    listed is refused (the listing is of another cache, or the cache is incomplete)."""
    want = set(volumes)
    out = dict.fromkeys(want, 0)
    seen = set()
    for path, size in files.items():
        parent = posixpath.dirname(path)
        while parent and parent not in want:
            parent = posixpath.dirname(parent)
        if parent:
            out[parent] += int(size)
            seen.add(parent)
    missing = sorted(want - seen)
    if missing:
        raise DataError(f"{len(missing)} volume(s) have no files in the cache listing, e.g. {missing[0]}")
    return out


def listed_bytes(cache: str, volumes) -> dict[str, int]:
    """volume_bytes from one recursive listing of the cache (local or gs://)."""
    return volume_bytes({p: int(i.get("size") or 0) for p, i in fsio.list_tree(cache).items()}, volumes)


def deal(rows: list[dict], sizes: dict[str, int], hosts: int) -> list[int]:
    """The host of each row: per device (in name order), rows largest first (ties by path), dealt
    in one snake order that runs on across scanners. Every host gets the same number of rows to
    within one, and of each device's bytes close to a 1/hosts part (the snake pairs a large
    volume with a small one in each round)."""
    if hosts == 1:
        return [0] * len(rows)
    by_device = defaultdict(list)
    for i, r in enumerate(rows):
        by_device[r["device"] or ""].append(i)
    out = [0] * len(rows)
    turn = 0
    for device in sorted(by_device):
        for i in sorted(by_device[device], key=lambda i: (-sizes[rows[i]["volume"]], rows[i]["relpath"])):
            lap, j = divmod(turn, hosts)
            out[i] = j if lap % 2 == 0 else hosts - 1 - j
            turn += 1
    return out


def shares(rows: list[dict], sizes: dict[str, int] | None, hosts: int) -> list[list[int]]:
    """Row indices of each host's share, in row order (`sizes` may be None for one host)."""
    owner = deal(rows, sizes or {}, hosts)
    out: list[list[int]] = [[] for _ in range(hosts)]
    for i, h in enumerate(owner):
        out[h].append(i)
    if min(len(s) for s in out) == 0:
        raise DataError(f"{len(rows)} training volume(s) cannot give each of {hosts} hosts a share")
    return out


def epoch_length(share_sizes: list[int], step: int) -> int:
    """Samples every host draws from its share per epoch: the smallest share, in whole per-host
    micro-steps (`step` = per-process batch x processes per host), so no host runs dry first."""
    n = min(share_sizes) // step * step
    if n == 0:
        raise DataError(f"a micro-step of {step} volume(s) a host is larger than the smallest host share "
                        f"({min(share_sizes)} training volumes): lower global_batch or raise chip_batch's accumulation")
    return n


class ShareSampler(EpochStream):
    """(epoch, row index) for one process: its host's share shuffled each epoch (seeded by the
    seed and the epoch), cut to `epoch_len`, dealt to the host's processes (local_rank every
    local_world-th), `batch` per micro-step, from micro-step `start_batch` to `stop_batch` (None:
    endless) counted across epochs. Together a host's processes consume its permutation as a
    prefix: a position is layout-free within the host (share_position)."""

    def __init__(self, share: list[int], epoch_len: int, batch: int, local_rank: int = 0, local_world: int = 1,
                 seed: int = 0, start_batch: int = 0, stop_batch: int | None = None):
        self.share, self.epoch_len, self.batch = share, epoch_len, batch
        self.local_rank, self.local_world, self.seed = local_rank, local_world, seed
        self.start_batch, self.stop_batch = start_batch, stop_batch
        self.batches_per_epoch = epoch_len // (batch * local_world)
        if self.batches_per_epoch == 0:
            raise DataError(f"a micro-step of {batch} x {local_world} process(es) is larger than the epoch of "
                            f"{epoch_len} volumes")

    def epoch_indices(self, epoch: int) -> list[int]:
        perm = epoch_permutation(len(self.share), self.seed, epoch)[: self.batches_per_epoch * self.batch * self.local_world]
        return [self.share[i] for i in perm[self.local_rank::self.local_world]]


def share_position(consumed: int, sampler: ShareSampler, hosts: int) -> dict:
    """Where `consumed` micro-batches per process left the data: the epoch, the samples drawn
    from each host's permutation in it, and the host count that made the shares."""
    s = sampler
    return {**data.data_position(consumed, s.epoch_len, s.batch, s.local_world), "hosts": hosts}


def start_for(position: dict, sampler: ShareSampler, hosts: int) -> tuple[int | None, str | None]:
    """(micro-batches per process that reach `position` with this sampler, a note when it is not
    exact). Exact when the hosts are the same and the offset is whole micro-steps of the host;
    None when it is not whole (the caller refuses). A checkpoint without `hosts` (one host) reads
    as one. Other hosts deal other shares, so the run goes on at the next epoch; an offset past
    this layout's shorter epoch does too."""
    was = int(position.get("hosts", 1))
    if was != hosts:
        return (position["epoch"] + 1) * sampler.batches_per_epoch, (
            f"{was} host(s) -> {hosts}: each host's share changes, so the data goes on at the start of epoch "
            f"{position['epoch'] + 1} (the rest of epoch {position['epoch']} is left out)")
    return data.start_batch_for(position, sampler.epoch_len, sampler.batch, sampler.local_world), None


# ---------------------------------------------------------------- what a host reads, and staging it

def validation_rows(cfg, val_rows: list[dict]) -> list[dict]:
    """The val rows validation may read: the first val_batches global batches in path order
    (Trainer.validate draws them unshuffled; fewer with accumulation), none when it is off."""
    return val_rows[: cfg.val_batches * cfg.global_batch] if cfg.val_every else []


def host_reads(cfg, rows: list[dict], sizes: dict[str, int] | None, host: int, hosts: int) -> set[str]:
    """The volumes host `host` of `hosts` reads in a run of `cfg` on training rows `rows`: its
    share, the rows validation reads and the online probe's (every host reads those two)."""
    from train import online_probe

    volumes = {rows[i]["volume"] for i in shares(rows, sizes, hosts)[host]}
    if cfg.val_every:
        val = data.select_rows(cfg.data.cache, ["val"], cfg.data.scanners)
        volumes |= {r["volume"] for r in validation_rows(cfg, val)}
    if cfg.eval_every:
        volumes |= {r["volume"] for split in online_probe.probe_rows(cfg).values() for r in split}
    return volumes




def stage_plan(cfg, listing: dict[str, int], host: int, hosts: int) -> tuple[list[str], dict]:
    """(the files to copy, the record to leave beside them) for host `host` of `hosts`: every file
    of the cache outside the volumes (manifest, sources), and the volumes host_reads names. The
    record holds every training volume's bytes, so the trainer deals the same shares from the
    staged copy, which lacks the other hosts' volumes."""
    from manifests import paths
    from train import data

    if not 0 <= host < hosts:
        raise DataError(f"HOST={host}: needs 0 <= HOST < HOSTS={hosts}")
    every = {r["volume"] for r in paths.read_manifest_table(cfg.data.cache).to_pylist() if r["volume"]}
    rows = data.select_rows(cfg.data.cache, cfg.data.splits, cfg.data.scanners)
    if not rows:
        raise DataError(f"data: no ok volumes in {cfg.data.cache} for splits {cfg.data.splits} and scanners "
                        f"{cfg.data.scanners}")
    sizes = volume_bytes(listing, [r["volume"] for r in rows])
    reads = host_reads(cfg, rows, sizes, host, hosts)
    copied = []
    for path in listing:
        parent = posixpath.dirname(path)
        while parent and parent not in every:
            parent = posixpath.dirname(parent)
        if not parent or parent in reads:
            copied.append(path)
    share = sum(sizes[v] for v in reads if v in sizes)
    record = {"host": host, "hosts": hosts, "source": cfg.data.cache, "volumes": sorted(reads),
              "share_bytes": share, "training_bytes": sum(sizes.values()), "bytes": sizes}
    return sorted(copied), record


def read_stage_record(cache: str) -> dict | None:
    """The record `make stage HOST=i HOSTS=n` left in a cache, None when it holds a whole cache."""
    import json

    from cache import stage

    try:
        return json.loads(fsio.read_text(fsio.join(cache, stage.RECORD)))
    except FileNotFoundError:
        return None


def training_sizes(cache: str, rows: list[dict], host: int, hosts: int) -> dict[str, int] | None:
    """The training volumes' bytes the shares are dealt by: none needed for one host; from the
    stage record of a cache staged for one host (checked to be this host's), else one listing."""
    record = read_stage_record(cache)
    if record is not None:
        if (record["host"], record["hosts"]) != (host, hosts):
            raise DataError(f"data.cache: {cache} holds host {record['host']} of {record['hosts']}'s share "
                            f"(make stage HOST={record['host']} HOSTS={record['hosts']}), but this is host {host} of "
                            f"{hosts}: stage this host's share (HOST={host} HOSTS={hosts})")
        missing = [r["volume"] for r in rows if r["volume"] not in record["bytes"]]
        if missing:
            raise DataError(f"data.cache: {cache} was staged for another selection of training volumes ({len(missing)} "
                            f"of this run's are not in it, e.g. {missing[0]}): stage it again with this run's CONFIG")
        return record["bytes"]
    return None if hosts == 1 else listed_bytes(cache, [r["volume"] for r in rows])


def whole_cache(cache: str, who: str) -> str:
    """The cache evaluation reads for `cache`: itself, or where a cache staged for one host was
    copied from (probes, embeddings and exports read every volume, not one host's share); said on
    stderr when it is the latter."""
    import sys

    record = read_stage_record(cache)
    if record is None:
        return cache
    print(f"{who}: {cache} holds host {record['host']} of {record['hosts']}'s share; reading the whole cache it was "
          f"staged from, {record['source']} (CACHE= or cache= names another)", file=sys.stderr)
    return record["source"]


def run_shares(cfg, rows: list[dict], host: int, hosts: int) -> tuple[list[list[int]], dict[str, int] | None]:
    """(every host's share of `rows`, the bytes they were dealt by) for a run of `cfg` on host
    `host` of `hosts`; on a cache staged for one host, also checked to hold what this host reads."""
    sizes = training_sizes(cfg.data.cache, rows, host, hosts)
    out = shares(rows, sizes, hosts)
    record = read_stage_record(cfg.data.cache)
    if record is not None:
        missing = sorted(host_reads(cfg, rows, sizes, host, hosts) - set(record["volumes"]))
        if missing:
            raise DataError(f"data.cache: {cfg.data.cache} lacks {len(missing)} volume(s) this run reads (e.g. "
                            f"{missing[0]}): it was staged for another config; stage it again with this run's "
                            f"CONFIG and ARGS")
    return out, sizes


def main(argv=None) -> int:
    """`make stage CACHE=gs://... LOCAL=... CONFIG=... HOST=i HOSTS=n`: one host's share."""
    import argparse
    import os
    import time

    from cache import stage
    from octfm import cli, config
    from train.config import TrainConfig

    ap = argparse.ArgumentParser(prog="make stage HOST=i HOSTS=n", description=main.__doc__)
    ap.add_argument("--config", required=True, help="the pretraining config the hosts will run (its data keys)")
    ap.add_argument("--cache", required=True, help="the cache to copy from (gs://..., rclone path or folder)")
    ap.add_argument("--local", required=True, help="this host's local destination")
    ap.add_argument("--host", type=int, required=True)
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--transfers", type=int, default=32)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the config (make ARGS), as the run gets them")
    a = ap.parse_args(argv)
    source = a.cache if fsio.is_remote(a.cache) else os.path.abspath(a.cache)  # the record names it for evaluation
    cfg = config.load(TrainConfig, a.config, [*a.overrides, f"data.cache={source}"])
    t0 = time.perf_counter()
    plan = {}

    def pick(listing: dict[str, int]) -> tuple[list[str], dict]:
        plan["paths"], plan["record"] = stage_plan(cfg, listing, a.host, a.hosts)
        return plan["paths"], plan["record"]

    s = stage.stage(a.cache, a.local, a.transfers, progress=not a.no_progress, pick=pick)
    rec = plan["record"]
    print(f"stage: host {a.host} of {a.hosts}: {len(rec['volumes'])} volumes, {rec['share_bytes'] / 1e9:.2f} GB of the "
          f"{rec['training_bytes'] / 1e9:.2f} GB of training volumes; {s['files']} files, {s['bytes'] / 1e6:.1f} MB "
          f"copied to {a.local} in {time.perf_counter() - t0:.1f}s")
    problems = [f"{sym} {path}" for sym, path in s["bad"]] or ([] if s["ok"] else ["rclone check failed"])
    return cli.report_verification("stage", problems, f"{s['files']} files by content hash")


if __name__ == "__main__":
    from octfm import cli as _cli

    _cli.run(main)
