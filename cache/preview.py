"""What `make cache` under a config will hold, before any file is read: the last part of
`make manifest`, from the sources.parquet it wrote (kept here, with the config it reads, so that
manifests/ imports nothing of the cache)."""
from __future__ import annotations

import argparse
from collections import Counter
from typing import Sequence

from cache.config import CacheConfig
from manifests import paths
from octfm import cli, config


def preview(rows: list[dict], cfg: CacheConfig) -> dict:
    """Per scanner and protocol the files `make cache` will cache, those the header decides (pattern
    not known by name), and those skipped; the bytes to read and to store (uint8 at the target shape,
    before compression)."""
    per: dict = {}
    read_bytes = 0
    for r in rows:
        if r["manifest_error"]:
            continue
        c = per.setdefault((r["device"] or "unknown", r["protocol"] or "unknown"), Counter())
        if cfg.select.skip_reason(r, final=False):
            c["skipped"] += 1
            continue
        c["cache" if r["scan_pattern"] else "header decides"] += 1
        read_bytes += r["size"] or 0
    volumes = sum(c["cache"] + c["header decides"] for c in per.values())
    voxels = cfg.preprocess.target_shape[0] * cfg.preprocess.target_shape[1] * cfg.preprocess.target_shape[2]
    return {"per": per, "volumes": volumes, "read_bytes": read_bytes, "stored_bytes": volumes * voxels,
            "skipped": sum(c["skipped"] for c in per.values()), "target_shape": list(cfg.preprocess.target_shape),
            "resample": cfg.preprocess.resample}


def print_preview(p: dict, config_path: str) -> None:
    kinds = ("cache", "header decides", "skipped")
    print(f"make cache ({config_path}, resample: {p['resample']}) will hold:")
    print(cli.format_table(["device", "protocol", *kinds],
                           [(d, pr, *(c[k] for k in kinds)) for (d, pr), c in sorted(p["per"].items())]))
    print(f"cache: up to {p['volumes']} volumes at {'x'.join(map(str, p['target_shape']))}: "
          f"{p['stored_bytes'] / 1e9:.2f} GB as uint8 before compression; {p['read_bytes'] / 1e9:.2f} GB to read "
          f"from the bucket; {p['skipped']} files skipped by select (configs/cache.yaml)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make manifest (preview)", description=__doc__)
    ap.add_argument("--cache", required=True, help="the cache root whose sources.parquet make manifest wrote")
    ap.add_argument("--config", default="configs/cache.yaml", help="the cache config whose `select` and target shape "
                    "it previews (make CONFIG=...)")
    ap.add_argument("overrides", nargs="*", help="key=value overrides of that config (as make cache's ARGS)")
    args = ap.parse_args(argv)
    cfg = config.load(CacheConfig, args.config, args.overrides)
    stored = paths.read_sources(args.cache)
    if stored is None:
        raise cli.UsageError(f"--cache {args.cache}: no {paths.SOURCES} there (run `make manifest` first)")
    print_preview(preview(stored[0], cfg), args.config)
    return 0


if __name__ == "__main__":
    cli.run(main)
