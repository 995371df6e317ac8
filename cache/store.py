"""One Zarr v3 array per cached volume: uint8, one chunk per volume, zstd through blosc.

Why one chunk: the trainer reads whole volumes, so one read and one decompression per
sample is the fastest layout; no sharding, because the GCS emulator (and some proxies)
ignore the suffix range requests a shard index needs.
Atomicity: locally the array is written under a temp name and renamed into place; on
gs:// the attributes (with the cache key) are written last, so a key present means the
data before it is complete.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import zarr
from zarr.codecs import BloscCodec
from zarr.storage import FsspecStore, LocalStore

from octfm import fsio

ATTR_KEY = "octfm"


def _store(uri: str, read_only: bool):
    if fsio.is_remote(uri):
        return FsspecStore.from_url(uri, storage_options=fsio.storage_options(uri), read_only=read_only)
    return LocalStore(uri, read_only=read_only)


def codec(cname: str = "zstd", clevel: int = 3) -> BloscCodec:
    return BloscCodec(cname=cname, clevel=clevel, shuffle="bitshuffle")


def write_volume(cache_root: str, rel: str, array: np.ndarray, attrs: dict,
                 cname: str = "zstd", clevel: int = 3, tag: str = "") -> None:
    """Write `array` with `attrs` under <cache_root>/<rel> so no reader sees half of it."""
    uri = fsio.join(cache_root, rel)
    if fsio.is_remote(uri):
        fs, path = fsio.filesystem(uri)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        arr = zarr.create_array(store=_store(uri, False), shape=array.shape, chunks=array.shape,
                                dtype=array.dtype, compressors=[codec(cname, clevel)], overwrite=True)
        arr[...] = array
        arr.attrs.put({ATTR_KEY: attrs})
        return
    final = os.path.abspath(uri)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, fsio.temp_name(name, tag))
    try:
        zarr.create_array(store=LocalStore(tmp), chunks=array.shape,
                          compressors=[codec(cname, clevel)], attributes={ATTR_KEY: attrs}, data=array)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def read_attrs(cache_root: str, rel: str) -> dict | None:
    """The octfm attributes of a cached volume, or None when absent or unreadable."""
    try:
        arr = zarr.open_array(store=_store(fsio.join(cache_root, rel), True), mode="r")
        return dict(arr.attrs.get(ATTR_KEY) or {}) or None
    except Exception:  # noqa: BLE001 - missing or half-written arrays are simply "not cached"
        return None


def read_volume(cache_root: str, rel: str) -> np.ndarray:
    """The whole cached volume as a numpy uint8 array [D, H, W]."""
    arr = zarr.open_array(store=_store(fsio.join(cache_root, rel), True), mode="r")
    return arr[...]
