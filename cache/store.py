"""One OME-Zarr image (NGFF 0.5, Zarr v3) per cached volume: uint8, one chunk, zstd through blosc.

Layout: `<volume>.zarr/` is a group whose attributes hold `ome` (multiscales with z/y/x
space axes in millimetres and a `scale` transform from the stored voxel size; a volume
without spacing gets unit-less axes and scale 1) and `octfm` (this project's provenance,
the cache key included); the array is `<volume>.zarr/0` with dimension_names z, y, x.
Viewers (napari with napari-ome-zarr) then show volumes at their physical size.
Why one chunk: the trainer reads whole volumes, so one read and one decompression per
sample is the fastest layout; no sharding, because the GCS emulator (and some proxies)
ignore the suffix range requests a shard index needs.
Atomicity: locally the group is written under a temp name and renamed into place; on
gs:// the group's attributes (with the cache key) are written last, so a key present
means the data before it is complete.
Caches written before this layout (a bare array per volume, cache code version 2) are not
read: the code version changed with the layout, so `make cache` rebuilds them once.
"""
from __future__ import annotations

import os
import posixpath
import shutil

import numpy as np
import zarr
from zarr.codecs import BloscCodec
from zarr.storage import FsspecStore, LocalStore

from octfm import fsio

ATTR_KEY = "octfm"
ARRAY_PATH = "0"                 # the full-resolution (and only) level of the multiscale image
AXES = ("z", "y", "x")           # stored D (frames), H (depth rows), W (columns)
OME_VERSION = "0.5"


def _store(uri: str, read_only: bool):
    if fsio.is_remote(uri):
        return FsspecStore.from_url(uri, storage_options=fsio.storage_options(uri), read_only=read_only)
    return LocalStore(uri, read_only=read_only)


def codec(cname: str = "zstd", clevel: int = 3, shuffle: str = "bitshuffle") -> BloscCodec:
    return BloscCodec(cname=cname, clevel=clevel, shuffle=shuffle)


def ome_attrs(spacing_mm: list[float] | None, name: str = "") -> dict:
    """The `ome` attributes of one volume: one scale level, z/y/x space axes in millimetres
    scaled by the stored voxel size; without a voxel size, unit-less axes and scale 1."""
    known = bool(spacing_mm) and all(v is not None for v in spacing_mm)
    axes = [{"name": a, "type": "space", **({"unit": "millimeter"} if known else {})} for a in AXES]
    scale = [float(v) for v in spacing_mm] if known else [1.0, 1.0, 1.0]
    return {"version": OME_VERSION, "multiscales": [{
        "name": name, "axes": axes,
        "datasets": [{"path": ARRAY_PATH, "coordinateTransformations": [{"type": "scale", "scale": scale}]}]}]}


def _write_image(store, array: np.ndarray, group_attrs: dict, cname: str, clevel: int) -> None:
    """The array at `0` with its data, then the group's attributes last (the completion mark)."""
    zarr.create_array(store=store, name=ARRAY_PATH, chunks=array.shape, compressors=[codec(cname, clevel)],
                      dimension_names=AXES, data=array)
    zarr.open_group(store=store, mode="r+").attrs.put(group_attrs)


def write_volume(cache_root: str, rel: str, array: np.ndarray, attrs: dict,
                 cname: str = "zstd", clevel: int = 3, tag: str = "") -> None:
    """Write `array` with `attrs` as an OME-Zarr image under <cache_root>/<rel> so no reader
    sees half of it."""
    uri = fsio.join(cache_root, rel)
    group_attrs = {"ome": ome_attrs(attrs.get("spacing_mm"), posixpath.basename(rel).removesuffix(".zarr")),
                   ATTR_KEY: attrs}
    if fsio.is_remote(uri):
        fs, path = fsio.filesystem(uri)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        _write_image(_store(uri, False), array, group_attrs, cname, clevel)
        return
    final = os.path.abspath(uri)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, fsio.temp_name(name, tag))
    try:
        _write_image(LocalStore(tmp), array, group_attrs, cname, clevel)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def read_attrs(cache_root: str, rel: str) -> dict | None:
    """The octfm attributes of a cached volume, or None when absent or unreadable."""
    try:
        group = zarr.open_group(store=_store(fsio.join(cache_root, rel), True), mode="r")
        return dict(group.attrs.get(ATTR_KEY) or {}) or None
    except Exception:  # noqa: BLE001 - missing or half-written volumes are simply "not cached"
        return None


def read_volume(cache_root: str, rel: str) -> np.ndarray:
    """The whole cached volume as a numpy uint8 array [D, H, W] (one metadata read, one chunk)."""
    uri = fsio.join(cache_root, rel)
    try:
        arr = zarr.open_array(store=_store(uri, True), path=ARRAY_PATH, mode="r")
    except FileNotFoundError:
        if _is_bare_array(uri):
            raise FileNotFoundError(f"{uri} is a cached volume of the layout before OME-Zarr (cache code version "
                                    "2): re-run `make cache` on this cache, which rebuilds it once") from None
        raise
    return arr[...]


def _is_bare_array(uri: str) -> bool:
    try:
        return isinstance(zarr.open(store=_store(uri, True), mode="r"), zarr.Array)
    except Exception:  # noqa: BLE001 - nothing there at all
        return False
