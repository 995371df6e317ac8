"""The `make cache` config (configs/cache.yaml): typed, unknown keys rejected."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ingest import preprocess as prep
from manifests import aireadi, protocols


@dataclasses.dataclass
class Select:
    """Which sources become volumes. Each key lists the values kept; an empty list keeps every value.
    A row that does not pass is `skipped`, with its reason: never failed, never cached. By default
    only raster volumes: a radial scan's B-scans are no volume (manifests/protocols.py)."""
    RENAMED: ClassVar[dict[str, str]] = {"device": "scanner"}   # read under the old name for one release
    scanner: list[str] = dataclasses.field(default_factory=list)       # the manifest's device values, e.g. [zeiss_cirrus]
    protocol: list[str] = dataclasses.field(default_factory=list)      # e.g. ["maestro2 3d wide oct", "cirrus mac oct"]
    region: list[str] = dataclasses.field(default_factory=list)        # macula, optic disc, wide field
    scan_pattern: list[str] = dataclasses.field(default_factory=lambda: [protocols.RASTER])  # + radial, line, unknown

    def __post_init__(self):
        from octfm.config import FieldError

        self.protocol = [protocols.canonical(p) for p in self.protocol]
        self.region = [protocols.region_word(r) for r in self.region]
        known = {"scanner": aireadi.DEVICES, "protocol": tuple(protocols.PROTOCOLS), "region": protocols.REGIONS,
                 "scan_pattern": (*protocols.PATTERNS, protocols.UNKNOWN)}
        for key, values in known.items():
            bad = [v for v in getattr(self, key) if v not in values]
            if bad:   # a value that names nothing would silently skip everything it meant to keep
                near = {b: protocols.nearest(b, values) for b in bad}
                hint = "; ".join(f"{b!r}: nearest {', '.join(n) if n else 'none'}" for b, n in near.items())
                raise FieldError(key, f"{bad} not known ({hint}); known: {', '.join(values)}")

    def skip_reason(self, row: dict, final: bool = True) -> str | None:
        """Why this row is not cached under this selection (None: it is), naming the key and the
        value that would take it. Not `final` (before the header is read): a value not known yet
        passes, for the header to tell."""
        checks = (("scanner", row.get("device")), ("protocol", row.get("protocol")),
                  ("region", protocols.region_word(row.get("anatomic_region"))), ("scan_pattern", row.get("scan_pattern")))
        for key, value in checks:
            kept = getattr(self, key)
            if value is None and not final:
                continue
            value = value or protocols.UNKNOWN
            if kept and value not in kept:
                return (f"not selected: {key} {value} (select.{key} keeps {', '.join(kept)}; "
                        f"select.{key}=[{','.join([*kept, value])}] takes it)")
        return None


@dataclasses.dataclass
class CacheConfig:
    preprocess: prep.PreprocessConfig = dataclasses.field(default_factory=prep.PreprocessConfig)
    select: Select = dataclasses.field(default_factory=Select)
    workers: int = 0
    codec: str = "zstd"
    clevel: int = 3
    flush_every_s: float = 30.0
    read_retries: int = 2              # attempts per source read (gcsfs adds its own ~30 s of backoff)
    read_timeout_s: float = 600.0      # one attempt's limit on an object store, the client's retries included
    abort_after_read_errors: int = 4   # consecutive rows that cannot be read: the store is gone, stop
