"""The `make cache` config (configs/cache.yaml): typed, unknown keys rejected."""
from __future__ import annotations

import dataclasses

from ingest import preprocess as prep


@dataclasses.dataclass
class CacheConfig:
    preprocess: prep.PreprocessConfig = dataclasses.field(default_factory=prep.PreprocessConfig)
    workers: int = 0
    codec: str = "zstd"
    clevel: int = 3
    flush_every_s: float = 30.0
    read_retries: int = 2              # attempts per source read (gcsfs adds its own ~30 s of backoff)
    read_timeout_s: float = 600.0      # one attempt's limit on an object store, the client's retries included
    abort_after_read_errors: int = 4   # consecutive rows that cannot be read: the store is gone, stop
