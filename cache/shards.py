"""Which sources one host of a sharded `make cache` builds.

The shard comes from `SHARD=i/N` when given, else from the scheduler that started the host:
a Cloud TPU VM worker (TPU_WORKER_ID with TPU_WORKER_HOSTNAMES, or the TPU metadata server
torch_xla also reads), a Cloud Batch task (BATCH_TASK_INDEX, BATCH_TASK_COUNT) or a
Kubernetes Indexed Job pod (JOB_COMPLETION_INDEX, with the count passed as SHARDS=N).
So one command runs unchanged on every host (`gcloud ... ssh --worker=all`).

Files are dealt to shards by source bytes, largest first, each to the shard with the fewest
bytes so far (ties: path order, then the lowest shard): a fixed assignment computed from the
sources table alone, so every host (and every re-run) agrees on it, and no host is left with
all the 256-frame volumes as a hash of the path can do.
"""
from __future__ import annotations

import dataclasses
import heapq
import os
import urllib.request

from octfm import cli

TPU_DEVICES = ("/dev/accel0", "/dev/vfio/0")  # TPU chips as a TPU VM shows them (v2-v4, v5 and later)
METADATA_ATTRS = "computeMetadata/v1/instance/attributes"


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    count: int
    origin: str   # where the numbers came from, printed by the command

    def __str__(self) -> str:
        return f"{self.index}/{self.count} (from {self.origin})"


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise cli.UsageError(f"SHARD={text!r}: expected i/N such as 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise cli.UsageError(f"SHARD={text!r}: need 0 <= i < N")
    return i, n


def _checked(index: str, count: str | int, origin: str) -> Shard:
    i, n = parse_shard(f"{index}/{count}")
    return Shard(i, n, origin)


def _metadata(key: str, host: str) -> str | None:
    req = urllib.request.Request(f"http://{host}/{METADATA_ATTRS}/{key}", headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None


def tpu_metadata(env) -> Shard | None:
    """A Cloud TPU VM's worker number and worker count from its metadata server (`tpu-env`
    WORKER_ID, `worker-network-endpoints`), asked only on a machine with TPU chips or when
    GCE_METADATA_HOST names a metadata server."""
    host = env.get("GCE_METADATA_HOST")
    if not host and not any(os.path.exists(p) for p in TPU_DEVICES):
        return None
    host = host or "metadata.google.internal"
    tpu_env, endpoints = _metadata("tpu-env", host), _metadata("worker-network-endpoints", host)
    if tpu_env is None or endpoints is None:
        return None
    worker = next((line.split(":", 1)[1].strip().strip("'\"") for line in tpu_env.splitlines()
                   if line.startswith("WORKER_ID:")), None)
    if worker is None:
        return None
    return _checked(worker, len(endpoints.split(",")), "the TPU VM metadata server (tpu-env WORKER_ID)")


def from_environment(env=None, count: int | None = None) -> Shard | None:
    """The shard a scheduler assigned this host, or None when nothing says so."""
    env = os.environ if env is None else env
    if env.get("TPU_WORKER_ID", "") != "":
        hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        n = count or len(hosts)
        if not n:
            raise cli.UsageError("TPU_WORKER_ID is set but TPU_WORKER_HOSTNAMES is not: pass SHARDS=N (the number of "
                                 "workers) or SHARD=i/N")
        return _checked(env["TPU_WORKER_ID"], n, "TPU_WORKER_ID/TPU_WORKER_HOSTNAMES (TPU VM worker)")
    if env.get("BATCH_TASK_INDEX", "") != "":
        if not env.get("BATCH_TASK_COUNT"):
            raise cli.UsageError("BATCH_TASK_INDEX is set but BATCH_TASK_COUNT is not")
        return _checked(env["BATCH_TASK_INDEX"], env["BATCH_TASK_COUNT"], "BATCH_TASK_INDEX/BATCH_TASK_COUNT (Cloud Batch)")
    if env.get("JOB_COMPLETION_INDEX", "") != "":
        if not count:
            raise cli.UsageError("JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job): pass SHARDS=N, the Job's "
                                 "completions, or SHARD=i/N")
        return _checked(env["JOB_COMPLETION_INDEX"], count, "JOB_COMPLETION_INDEX and SHARDS (Kubernetes Indexed Job)")
    return tpu_metadata(env)


def resolve(explicit: str | None, count: int | None = None, env=None) -> Shard:
    """SHARD=i/N when given, else the scheduler's, else the whole dataset (0/1)."""
    if explicit:
        i, n = parse_shard(explicit)
        return Shard(i, n, f"SHARD={explicit}")
    return from_environment(env, count) or Shard(0, 1, "default: no SHARD and no scheduler variables")


def assign(rows: list[dict], count: int) -> dict[str, int]:
    """relpath -> shard, balancing source bytes: largest first, each to the lightest shard."""
    heap = [(0, i) for i in range(count)]
    out: dict[str, int] = {}
    for r in sorted(rows, key=lambda r: (-(r.get("size") or 0), r["relpath"])):
        total, i = heapq.heappop(heap)
        out[r["relpath"]] = i
        heapq.heappush(heap, (total + (r.get("size") or 0), i))
    return out


def select(rows: list[dict], shard: tuple[int, int]) -> list[dict]:
    """This shard's rows, in their original order."""
    owner = assign(rows, shard[1])
    return [r for r in rows if owner[r["relpath"]] == shard[0]]


def bytes_per_shard(rows: list[dict], count: int) -> list[int]:
    owner = assign(rows, count)
    totals = [0] * count
    for r in rows:
        totals[owner[r["relpath"]]] += r.get("size") or 0
    return totals


def balance_line(rows: list[dict], shard: tuple[int, int]) -> str:
    """This shard's share of the files and bytes, and the largest shard against the mean."""
    totals = bytes_per_shard(rows, shard[1])
    mine = sum(1 for r in select(rows, shard))
    mean = sum(totals) / shard[1]
    ratio = f"{max(totals) / mean:.3f}x" if mean else "n/a"
    return (f"{mine} of {len(rows)} files, {totals[shard[0]] / 1e9:.3f} of {sum(totals) / 1e9:.3f} GB "
            f"(largest shard {ratio} the mean, by source bytes)")
