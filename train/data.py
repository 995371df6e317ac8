"""The training Dataset over the local cache, and a deterministic, resumable sampler.

Every random choice for a sample (crop, flip, masks, intensity jitter) comes from a
generator seeded by (seed, epoch, sample index): results do not depend on the number of
workers or processes, and a resumed run sees exactly what an uninterrupted one would.
Host-side work keeps uint8; the float conversion and intensity jitter happen on the device.
"""
from __future__ import annotations

import functools
import json
import os
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from cache import store
from manifests import paths
from octfm.errors import DataError
from train import masks as M
from train.config import DataConfig, MaskConfig

PIXEL_MEAN, PIXEL_STD = 0.5, 0.25  # of uint8/255 intensities after the cache's window


def normalize(x_u8: torch.Tensor, aug: torch.Tensor | None = None, mean: float = PIXEL_MEAN,
              std: float = PIXEL_STD) -> torch.Tensor:
    """uint8 [B,1,D,H,W] -> float on the device, with per-sample gain/offset jitter `aug` [B, 2]
    (None: none, as evaluation sees volumes). Shared by the trainer, the probes' feature
    extraction, fine-tuning and exported encoders, which pass the mean and std their config.json
    records."""
    x = x_u8.float().div_(255.0)
    if aug is not None:
        x = x * aug[:, 0].view(-1, 1, 1, 1, 1) + aug[:, 1].view(-1, 1, 1, 1, 1)
    return (x - mean) / std


def select_rows(cache: str, splits, scanners, labelled: bool = False) -> list[dict]:
    """Manifest rows usable for training: status ok, in the splits and scanners asked for (and
    with a label, for whatever trains or scores on labels). The one reader of the manifest for
    training and evaluation, sorted by path."""
    try:
        table = paths.read_manifest_table(cache)
    except FileNotFoundError:
        raise DataError(f"data.cache: no manifest at {paths.manifest_uri(cache)} "
                         "(run `make cache` / `make stage` first)") from None
    rows = [r for r in table.to_pylist() if r["status"] == "ok" and r["split"] in splits
            and (scanners is None or r["device"] in scanners) and not (labelled and r["label"] is None)]
    return sorted(rows, key=lambda r: r["relpath"])


MAX_DEFAULT_WORKERS = 32  # each holds prefetch_factor batches of uint8 volumes in host memory


def loader_workers(workers: int | None) -> int:
    """`data.workers`, or when None the cores this process may use, shared among the processes
    of this host (torchrun's LOCAL_WORLD_SIZE), less one for the process itself: the random-
    resized crop costs about 85 ms of one core per production sample, so the loader needs cores
    in proportion to the chips' pace (docs/accelerators.md)."""
    if workers is not None:
        return workers
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(MAX_DEFAULT_WORKERS, len(os.sched_getaffinity(0)) // per_host - 1))


def batch_loader(ds: Dataset, batch: int, sampler: Sampler, workers: int | None, start_method: str, pin: bool,
                 prefetch_factor: int = 2, worker_log: str | None = None) -> DataLoader:
    """The one DataLoader setup of every training loop (pretraining, fine-tuning and so the supervised
    references): whole batches from the sampler's keys; `workers` (data.workers: None for the default,
    loader_workers) persistent processes of the shared context (octfm/procs.py, started early with the
    imports preloaded), pinned memory where batches go to a GPU; `worker_log`: each worker notes its
    start there (note_worker_start)."""
    from octfm import procs

    n = loader_workers(workers)
    kw = {}
    if n > 0:
        kw = {"num_workers": n, "multiprocessing_context": procs.worker_context(start_method),
              "persistent_workers": True, "prefetch_factor": prefetch_factor,
              "worker_init_fn": functools.partial(note_worker_start, worker_log) if worker_log else None}
    return DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True, pin_memory=pin, **kw)


def note_worker_start(path: str, worker_id: int) -> None:
    """A loader's `worker_init_fn` (functools.partial with `path`): appends when this worker
    process was forked and when it became ready (its imports and the dataset's unpickling done),
    wall-clock seconds, one JSON line per worker. The run's startup record splits the first
    batch's wait with it (train/startup.py `Startup`; the H200's 89 s, docs/accelerators.md).
    A diagnostic never stops a worker: without /proc or CLOCK_BOOTTIME (not Linux) it notes
    nothing, and a log gone (a worker ready after the startup record) or a full or read-only
    disk is passed over."""
    try:
        with open("/proc/self/stat") as f:  # field 22 (after the command's closing parenthesis): ticks after boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        now = time.time()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        line = json.dumps({"worker": worker_id, "pid": os.getpid(), "forked": now - age, "ready": now}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # appended, never created: the folder may be gone
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError, AttributeError):
        pass


def strided_shape(shape, stride) -> list[int]:
    """A cached volume's shape after `data.stride` (every stride-th voxel from the first)."""
    return [-(-int(n) // int(s)) for n, s in zip(shape, stride)]


def read_strided(cache: str, row: dict, stride) -> np.ndarray:
    """A row's cached volume with `data.stride` applied, contiguous: uint8 [D, H, W]."""
    return np.ascontiguousarray(store.read_volume(cache, row["volume"])[::stride[0], ::stride[1], ::stride[2]])


def draw_box(rng: np.random.Generator, full, shape, scale, zoom: bool) -> np.ndarray:
    """(start d, h, w, size d, h, w): a box of `shape` (or, with `zoom`, of a size drawn per axis
    between scale[0] and scale[1] of it, as MONAI's RandSpatialCrop with random_size) at a
    uniformly random place inside `full`: the crop the resident volumes cut (train/resident.py)."""
    if zoom:
        size = [int(rng.integers(max(1, round(scale[0] * n)), max(1, round(scale[1] * n)) + 1)) for n in shape]
    else:
        size = [int(n) for n in shape]
    start = [int(rng.integers(0, f - s + 1)) for f, s in zip(full, size)]
    return np.array(start + size, dtype=np.int32)


def sample_rng(seed: int, epoch: int, index: int, stream: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, epoch, index, stream]))


class CacheDataset(Dataset):
    """Items are addressed by (epoch, index) so the epoch reaches persistent workers."""

    def __init__(self, rows: list[dict], cfg: DataConfig, mask_cfg: MaskConfig | None, grid: M.Grid | None,
                 sizes: list[M.SetSize] | None, seed: int, augment: bool = True, volumes: bool = True):
        """`mask_cfg` None: items carry no mask sets (fine-tuning reads only the crops).
        `volumes` False: items carry the row index, the crop box and the flip instead of the crop
        (the volumes are resident on the device: train/resident.py)."""
        # only what an item reads: the dataset is pickled to every loader worker (1.7 MB for the
        # learning check's 1,565 full manifest rows, 0.25 MB so)
        self.rows = [{"volume": r["volume"], "shape": r["shape"]} for r in rows]
        self.cfg, self.mask_cfg, self.grid, self.sizes = cfg, mask_cfg, grid, sizes
        self.seed, self.augment, self.volumes = seed, augment, volumes
        self._transforms = None
        for r in rows[:1]:
            strided = strided_shape(r["shape"], cfg.stride)
            if any(s < i for s, i in zip(strided, cfg.input_shape)):
                raise DataError(f"data.input_shape {list(cfg.input_shape)} is larger than the cached volumes "
                                 f"{r['shape']} after data.stride {list(cfg.stride)}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict:
        """Workers build their own transforms: building them is what turns MONAI's meta tracking
        off in that process, so a copy built here (the XLA loader reads one item first) would
        make the workers return MetaTensors, which torch_xla's loader refuses."""
        return {**self.__dict__, "_transforms": None}

    @property
    def zooms(self) -> bool:
        return self.augment and tuple(self.cfg.scale) != (1.0, 1.0)

    def transforms(self):
        """MONAI spatial transforms on uint8, meta tracking off: a random crop of input_shape,
        or with data.scale a random box of a fraction of it resized back (trilinear), then the
        left-right flip."""
        if self._transforms is None:
            import monai
            from monai.transforms import Compose, RandFlip, RandSpatialCrop, Resize

            monai.data.set_track_meta(False)
            shape = tuple(self.cfg.input_shape)
            if self.zooms:
                lo, hi = self.cfg.scale
                crop = [RandSpatialCrop(tuple(max(1, round(lo * n)) for n in shape),
                                        max_roi_size=tuple(max(1, round(hi * n)) for n in shape), random_size=True),
                        Resize(shape, mode="trilinear")]
            else:
                crop = [RandSpatialCrop(shape, random_size=False)]
            self._transforms = Compose([
                *crop, RandFlip(prob=self.cfg.flip_prob if self.augment else 0.0, spatial_axis=2),
            ])
        return self._transforms

    def crop(self, row: dict, seed: int) -> torch.Tensor:
        """The row's volume, strided, through the transforms seeded with `seed`: uint8 [1, D, H, W]."""
        vol = read_strided(self.cfg.cache, row, self.cfg.stride)[None]
        t = self.transforms()
        t.set_random_state(seed=seed)
        x = torch.as_tensor(t(vol))
        if x.is_floating_point():  # resized: round back to the cache's grey levels
            x = x.round_().clamp_(0, 255)
        return x.to(torch.uint8).contiguous()

    def __getitem__(self, key) -> dict:
        epoch, index = key
        row = self.rows[index]
        rng = sample_rng(self.seed, epoch, index)
        crop_seed = int(rng.integers(2 ** 31))  # drawn in both modes: the masks and jitter below stay the same
        if self.volumes:
            item = {"x": self.crop(row, crop_seed)}
        else:
            crop_rng = sample_rng(self.seed, epoch, index, stream=1)
            full = strided_shape(row["shape"], self.cfg.stride)
            box = draw_box(crop_rng, full, self.cfg.input_shape, self.cfg.scale, self.zooms)
            flip = self.augment and crop_rng.random() < self.cfg.flip_prob
            item = {"index": torch.tensor(index, dtype=torch.int64), "box": torch.from_numpy(box),
                    "flip": torch.tensor(bool(flip))}
        sets = [] if self.mask_cfg is None else M.sample_masks(self.grid, self.mask_cfg, self.sizes, rng)
        jitter = self.cfg.intensity_jitter if self.augment else 0.0
        aug = torch.tensor([1.0 + rng.uniform(-jitter, jitter), rng.uniform(-jitter, jitter)], dtype=torch.float32)
        item["aug"] = aug
        for i, (c, g, _) in enumerate(sets):  # flat keys: XLA's loader shards a flat dict of tensors
            item[f"ctx_{i}"] = torch.from_numpy(c.astype(np.int32))  # int32: int64 is emulated on TPU
            item[f"tgt_{i}"] = torch.from_numpy(g.astype(np.int32))
        return item


def mask_pairs(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(context ids [B, Kc], target ids [B, Kt]), ...] for each mask set of a batch."""
    n = sum(1 for k in batch if k.startswith("ctx_"))
    return [(batch[f"ctx_{i}"], batch[f"tgt_{i}"]) for i in range(n)]


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The order of `n` rows in `epoch`: the same on every process and on a resume."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()


class EpochStream(Sampler):
    """A stream of (epoch, index), `batch` per process per micro-step, from batch `start_batch` to
    `stop_batch` (None: endless) counted across epochs, an epoch being what `epoch_indices(epoch)`
    deals this process (`batches_per_epoch` whole batches). Finite streams let loader threads finish
    before the interpreter exits. Subclasses say which rows an epoch deals: EpochSampler (all rows,
    every process) and shares.ShareSampler (a host's share)."""
    batch: int
    batches_per_epoch: int
    start_batch: int
    stop_batch: int | None

    def epoch_indices(self, epoch: int) -> list[int]:
        raise NotImplementedError

    def __iter__(self):
        epoch, b = divmod(self.start_batch, self.batches_per_epoch)
        left = None if self.stop_batch is None else max(0, self.stop_batch - self.start_batch) * self.batch
        while left is None or left > 0:
            idx = self.epoch_indices(epoch)[b * self.batch:]
            if left is not None:
                idx = idx[:left]
                left -= len(idx)
            for i in idx:
                yield (epoch, i)
            epoch, b = epoch + 1, 0

    def __len__(self) -> int:
        if self.stop_batch is None:
            return 2 ** 62  # endless
        return max(0, self.stop_batch - self.start_batch) * self.batch


class EpochSampler(EpochStream):
    """All `n` rows each epoch (shuffled by seed and epoch, or in order), trimmed to whole global
    batches so every process sees the same number of batches (no rank runs dry and hangs a
    collective), dealt rank every world-th."""

    def __init__(self, n: int, batch: int, rank: int = 0, world: int = 1, seed: int = 0,
                 shuffle: bool = True, start_batch: int = 0, stop_batch: int | None = None):
        self.n, self.batch, self.rank, self.world, self.seed = n, batch, rank, world, seed
        self.shuffle, self.start_batch, self.stop_batch = shuffle, start_batch, stop_batch
        self.batches_per_epoch = n // (batch * world)
        if self.batches_per_epoch == 0:
            raise DataError(f"batch_size {batch} x {world} process(es) is larger than the {n} training volumes")

    def epoch_indices(self, epoch: int) -> list[int]:
        perm = epoch_permutation(self.n, self.seed, epoch) if self.shuffle else list(range(self.n))
        perm = perm[: self.batches_per_epoch * self.batch * self.world]
        return perm[self.rank::self.world]


def data_position(consumed: int, n: int, batch: int, world: int) -> dict:
    """Where `consumed` batches per process left the stream, in layout-free terms: the epoch
    and the samples drawn from its permutation (the processes' batches together are a
    prefix of it: rank r takes every world-th sample)."""
    epoch, b = divmod(consumed, n // (batch * world))
    return {"epoch": epoch, "offset": b * batch * world}


def start_batch_for(position: dict, n: int, batch: int, world: int) -> int:
    """Batches per process that reach `position` with `batch` x `world`: exact when the offset
    is whole global batches; None when it is not (the caller refuses). An offset past the
    new, shorter trimmed epoch starts the next epoch (the samples between are the ones this
    layout trims)."""
    per_epoch = n // (batch * world)
    g = batch * world
    if position["offset"] >= per_epoch * g:
        return (position["epoch"] + 1) * per_epoch
    if position["offset"] % g:
        return None
    return position["epoch"] * per_epoch + position["offset"] // g
