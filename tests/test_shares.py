"""Each host reads its own share (train/shares.py): the shares balance bytes, a host's loader reads
only its share over the epochs (measured here on emulated hosts), and `make stage HOST=i HOSTS=n`
copies one host's share plus what every host reads, which a trainer on that host then runs from."""
import json

import pytest
import torch

from conftest import tiny_train_args
from cache import stage
from octfm import config, fsio
from octfm.config import ConfigError
from octfm.errors import DataError
from train import data, pretrain, runtime, shares
from train.config import TrainConfig

SMOKE = "configs/pretrain_smoke.yaml"


def _rows(n: int, devices: str = "abc") -> tuple[list[dict], dict]:
    rows = [{"volume": f"volumes/v{i:03d}.zarr", "relpath": f"r{i:03d}", "device": devices[i % len(devices)]}
            for i in range(n)]
    sizes = {r["volume"]: 1000 + (i * 7919) % 5000 for i, r in enumerate(rows)}
    return rows, sizes


def test_shares_split_every_device_and_its_bytes_evenly():
    rows, sizes = _rows(203)
    parts = shares.shares(rows, sizes, 4)
    assert sorted(i for p in parts for i in p) == list(range(len(rows)))        # each row on one host
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for device in "abc":
        held = [sum(sizes[rows[i]["volume"]] for i in p if rows[i]["device"] == device) for p in parts]
        assert max(held) / min(held) < 1.1, (device, held)                       # within 10% of each other
    assert shares.shares(rows, sizes, 4) == parts                                 # the same deal every time


def test_volume_bytes_sum_a_volumes_files_and_refuse_a_listing_without_it():
    files = {"manifest.parquet/part-0.parquet": 50, "volumes/a/x.zarr/zarr.json": 3,
             "volumes/a/x.zarr/0/c/0/0/0": 100, "volumes/a/y.zarr/0/c/0/0/0": 7}
    assert shares.volume_bytes(files, ["volumes/a/x.zarr", "volumes/a/y.zarr"]) == {"volumes/a/x.zarr": 103,
                                                                                    "volumes/a/y.zarr": 7}
    with pytest.raises(DataError, match="1 volume.*no files.*volumes/b.zarr"):
        shares.volume_bytes(files, ["volumes/a/x.zarr", "volumes/b.zarr"])


def _host_reads(cfg, rows: list[dict], sampler, monkeypatch) -> list[str]:
    """The volumes one host's loader reads from the cache, in order, through the trainer's dataset
    (every data.read_strided call counted)."""
    reads, real = [], data.read_strided
    monkeypatch.setattr(data, "read_strided", lambda cache, row, stride: reads.append(row["volume"]) or
                        real(cache, row, stride))
    ds = data.CacheDataset(rows, cfg.data, None, None, None, cfg.seed)
    for key in sampler:
        ds[key]
    return reads


def test_each_emulated_host_reads_its_share_over_two_epochs(tiny_cache, monkeypatch):
    """Four emulated hosts, one process each, two epochs of the trainer's own sampler through the
    dataset it reads: each host reads only its share (about a quarter of the training bytes), each
    volume at most once an epoch, where the sampler before shares (each epoch's one permutation dealt
    rank::world) sent every host over most of the cache. The numbers (bytes per host against the
    whole) are docs/accelerators.md's."""
    hosts = 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")                  # one process a host
    monkeypatch.setattr(fsio, "is_shared", lambda *a: True)      # hosts emulated in one process
    cfg = config.load(TrainConfig, SMOKE, [*tiny_train_args(tiny_cache, tiny_cache.parent / "runs"),
                                           f"global_batch={hosts}"])
    rows = data.select_rows(str(tiny_cache), ["train"], None)
    sizes = shares.listed_bytes(str(tiny_cache), [r["volume"] for r in rows])
    whole, parts = sum(sizes.values()), shares.shares(rows, sizes, hosts)
    for host in range(hosts):
        tr = pretrain.Trainer(cfg, runtime.Runtime("cpu", torch.device("cpu"), rank=host, world=hosts))
        epoch_len = tr.sampler().batches_per_epoch
        reads = _host_reads(cfg, tr.rows, tr.sampler(0, 2 * epoch_len), monkeypatch)
        share = {rows[i]["volume"] for i in parts[host]}
        assert len(reads) == 2 * epoch_len and set(reads) <= share, host
        assert max(reads.count(v) for v in reads) <= 2                          # at most once an epoch
        held = sum(sizes[v] for v in share)
        assert 0.15 < held / whole < 0.35, (host, held, whole)
        before = set(_host_reads(cfg, rows, data.EpochSampler(len(rows), 1, host, hosts, seed=0,
                                                             stop_batch=2 * (len(rows) // hosts)), monkeypatch))
        assert sum(sizes[v] for v in before) > held and before - share          # the old deal: beyond its share


def test_a_host_staged_share_trains_and_another_hosts_cache_is_refused(tiny_cache, tmp_path, monkeypatch):
    """`make stage HOST=i HOSTS=2` (train.shares.main, as the Makefile runs it) copies host i's share of
    the training volumes, the val rows validation reads and the online probe's rows, and a record;
    the two shares are disjoint and cover the training volumes. Host 1's trainer deals the same shares
    from the record and reads two epochs from its copy alone; resident volumes (every training volume on
    each process) are refused on several hosts; host 0's copy is refused on host 1."""
    over = tiny_train_args(tiny_cache, tmp_path / "runs", val_every=2, val_batches=1, eval_every=2,
                           **{"online_probe.max_train": 2, "online_probe.max_val": 2})
    over = [o for o in over if not o.startswith("data.cache=")]
    local = [tmp_path / f"host{h}" for h in (0, 1)]
    for h in (0, 1):
        assert shares.main(["--config", SMOKE, "--cache", str(tiny_cache), "--local", str(local[h]), "--host", str(h),
                            "--hosts", "2", "--no-progress", *over]) == 0
    recs = [json.loads((folder / stage.RECORD).read_text()) for folder in local]
    rows = data.select_rows(str(tiny_cache), ["train"], None)
    train = {r["volume"] for r in rows}
    own = [{rows[i]["volume"] for i in part} for part in shares.shares(rows, recs[0]["bytes"], 2)]
    assert not own[0] & own[1] and own[0] | own[1] == train
    staged = [set(r["volumes"]) for r in recs]      # a share, and val's and the online probe's rows on every host
    assert staged[0] | own[1] == staged[1] | own[0] and 0 < len(staged[0] - own[0]) <= 2 + 2 + 2
    common = (staged[0] - own[0]) | (staged[1] - own[1])
    for folder, rec in zip(local, recs):
        on_disk = {v for v in train | common if (folder / v).exists()}
        assert on_disk == set(rec["volumes"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(fsio, "is_shared", lambda *a: True)   # two emulated hosts in one process: no checkpoint is written
    rt = runtime.Runtime("cpu", torch.device("cpu"), rank=1, world=2)
    cfg = config.load(TrainConfig, SMOKE, [*over, f"data.cache={local[1]}", "global_batch=2"])
    tr = pretrain.Trainer(cfg, rt)
    assert [len(s) for s in tr.shares] == [len(own[0]), len(own[1])] and "2 hosts, each reading its own share" \
        in tr.share_line()
    sampler, dl = tr.train_loader(0, 2 * tr.sampler().batches_per_epoch)
    assert sum(1 for _ in dl) == 2 * sampler.batches_per_epoch                  # every read from host 1's copy
    always = pretrain.Trainer(config.load(TrainConfig, SMOKE, [*over, f"data.cache={local[1]}", "global_batch=2",
                                                               "data.resident=always"]), rt)
    with pytest.raises(ConfigError, match="data.resident: always loads all .* each of the 2 hosts reads only its share"):
        always.wants_resident()                   # the resident tensor would hold volumes this host never staged
    with pytest.raises(DataError, match=r"holds host 0 of 2's share .* this is host 1 of 2"):
        pretrain.Trainer(config.load(TrainConfig, SMOKE, [*over, f"data.cache={local[0]}", "global_batch=2"]), rt)
