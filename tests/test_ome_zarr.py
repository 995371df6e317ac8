"""Cached volumes are OME-Zarr images (NGFF 0.5): validated by ome-zarr-models, an
independent reader, which gets back the same bytes and the stored voxel size."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import zarr
from ome_zarr_models.v05.image import Image
from zarr.storage import LocalStore

from cache import store


def open_image(root, rel) -> tuple[Image, zarr.Group]:
    group = zarr.open_group(store=LocalStore(str(root / rel), read_only=True), mode="r")
    return Image.from_zarr(group), group


def scale_and_units(img: Image) -> tuple[list[float], list]:
    ms = img.ome_attributes.multiscales[0]
    assert [a.name for a in ms.axes] == ["z", "y", "x"] and {a.type for a in ms.axes} == {"space"}
    (transform,) = ms.datasets[0].coordinateTransformations
    return list(transform.scale), [a.unit for a in ms.axes]


def test_every_cached_volume_validates_and_reads_back_the_same_bytes_and_scale(tiny_cache):
    df = pd.read_parquet(tiny_cache / "manifest.parquet")
    ok = df[df.status == "ok"]
    assert len(ok) >= 10
    for row in ok.itertuples():
        img, group = open_image(tiny_cache, row.volume)
        scale, units = scale_and_units(img)
        np.testing.assert_allclose(scale, row.spacing_mm, rtol=1e-12)
        assert units == ["millimeter"] * 3
        (path,) = img.ome_attributes.get_array_paths()
        arr = group[path]
        assert arr.metadata.dimension_names == ("z", "y", "x") and arr.dtype == np.uint8
        assert arr[...].tobytes() == store.read_volume(str(tiny_cache), row.volume).tobytes()
        assert list(arr.shape) == list(row.shape)
        octfm = group.attrs["octfm"]  # the project's attributes beside `ome`
        assert octfm["cache_key"] == row.cache_key and octfm["spacing_mm"] == list(row.spacing_mm)


def test_a_volume_without_voxel_size_has_unitless_axes_and_scale_one(tmp_path):
    vol = np.random.default_rng(0).integers(0, 255, (4, 6, 8), dtype=np.uint8)
    store.write_volume(str(tmp_path), "v.zarr", vol, {"spacing_mm": None, "cache_key": "k"})
    img, _ = open_image(tmp_path, "v.zarr")
    assert scale_and_units(img) == ([1.0, 1.0, 1.0], [None, None, None])
    assert store.read_volume(str(tmp_path), "v.zarr").tobytes() == vol.tobytes()
    assert store.read_attrs(str(tmp_path), "v.zarr") == {"spacing_mm": None, "cache_key": "k"}


def test_a_volume_of_the_old_layout_says_to_rebuild(tmp_path):
    zarr.create_array(store=LocalStore(str(tmp_path / "old.zarr")), chunks=(2, 2, 2), data=np.zeros((2, 2, 2), np.uint8))
    with pytest.raises(FileNotFoundError, match=r"layout before OME-Zarr .* re-run `make cache`"):
        store.read_volume(str(tmp_path), "old.zarr")
    assert store.read_attrs(str(tmp_path), "old.zarr") is None  # not trusted: the build redoes it
