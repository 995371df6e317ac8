"""Shards a scheduler hands out: the index from the environment (SHARD=i/N wins), and files
dealt by source bytes so hosts get similar work."""
from __future__ import annotations

import http.server
import random
import threading
import zlib

import pytest

from cache import shards
from ingest import synth
from manifests import build as manifest_build
from octfm.cli import UsageError

# frames x rows x cols per device, as synth writes them: sizes differ about 5x between devices
SHAPES = {name: spec.shape for name, spec in synth.DEVICES.items()}


@pytest.mark.parametrize("env,count,expected", [
    ({"BATCH_TASK_INDEX": "2", "BATCH_TASK_COUNT": "5"}, None, (2, 5, "Cloud Batch")),
    ({"JOB_COMPLETION_INDEX": "3"}, 4, (3, 4, "Kubernetes Indexed Job")),
    ({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t-w-0,t-w-1,t-w-2,t-w-3"}, None, (1, 4, "TPU VM worker")),
    ({}, None, (0, 1, "default")),
])
def test_the_shard_comes_from_the_scheduler_environment(env, count, expected):
    s = shards.resolve(None, count, env)
    assert (s.index, s.count) == expected[:2] and expected[2] in s.origin


def test_an_explicit_shard_wins_and_bad_environments_are_refused():
    env = {"BATCH_TASK_INDEX": "2", "BATCH_TASK_COUNT": "5"}
    assert shards.resolve("0/3", None, env) == shards.Shard(0, 3, "SHARD=0/3")
    with pytest.raises(UsageError, match="pass SHARDS=N"):
        shards.resolve(None, None, {"JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(UsageError, match="need 0 <= i < N"):
        shards.resolve(None, None, {"BATCH_TASK_INDEX": "5", "BATCH_TASK_COUNT": "5"})


def test_a_tpu_vm_worker_is_read_from_the_metadata_server():
    """A real HTTP server on loopback answering as the TPU VM metadata server does."""
    answers = {"/computeMetadata/v1/instance/attributes/tpu-env": "ACCELERATOR_TYPE: 'v4-32'\nWORKER_ID: '2'\n",
               "/computeMetadata/v1/instance/attributes/worker-network-endpoints": "a:1:10.0.0.1,b:2:10.0.0.2,"
                                                                                  "c:3:10.0.0.3,d:4:10.0.0.4"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = answers.get(self.path)
            ok = body is not None and self.headers.get("Metadata-Flavor") == "Google"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        s = shards.resolve(None, None, {"GCE_METADATA_HOST": f"127.0.0.1:{server.server_port}"})
    finally:
        server.shutdown()
    assert (s.index, s.count) == (2, 4) and "metadata server" in s.origin


@pytest.fixture(scope="module")
def mixed_sources(tmp_path_factory) -> list[dict]:
    """A listed tree whose files have the devices' relative sizes (1/2048 of the voxels)."""
    root = tmp_path_factory.mktemp("mixed") / "ds"
    synth.generate(root, synth.SynthConfig(participants=40, seed=3, bad_files=False, placeholders=True))
    for path in root.rglob("*.dcm"):
        device = next(d for d in SHAPES if d in path.parts)
        f, r, c = SHAPES[device]
        path.write_bytes(b"\0" * (f * r * c // 2048 + random.Random(str(path)).randrange(1000)))
    rows, _ = manifest_build.build_sources(str(root))
    return rows


def test_shards_balance_source_bytes_within_ten_percent(mixed_sources):
    sizes = {r["size"] for r in mixed_sources}
    assert len(mixed_sources) > 60 and max(sizes) > 4 * min(sizes)
    for n in (2, 4, 8):
        totals = shards.bytes_per_shard(mixed_sources, n)
        mean = sum(totals) / n
        assert max(totals) <= 1.10 * mean, (n, totals)
        picked = [r["relpath"] for i in range(n) for r in shards.select(mixed_sources, (i, n))]
        assert sorted(picked) == sorted(r["relpath"] for r in mixed_sources)  # every file in exactly one shard
    shuffled = random.Random(0).sample(mixed_sources, len(mixed_sources))
    assert shards.assign(shuffled, 4) == shards.assign(mixed_sources, 4)  # fixed by the table, not its order


def balance_report(rows: list[dict], n: int) -> dict:
    """The byte balance of this rule and of the path hash it replaced (for the record)."""
    hashed = [0] * n
    for r in rows:
        hashed[zlib.crc32(r["relpath"].encode()) % n] += r["size"]
    by_bytes = shards.bytes_per_shard(rows, n)
    return {"by_bytes": max(by_bytes) / (sum(by_bytes) / n), "path_hash": max(hashed) / (sum(hashed) / n)}


def test_the_byte_rule_beats_the_path_hash(mixed_sources):
    report = balance_report(mixed_sources, 4)
    print(f"largest shard / mean, 4 shards, {len(mixed_sources)} files: {report}")
    assert report["by_bytes"] <= report["path_hash"]


def test_the_tpu_extra_pins_the_torch_xla_the_xla_lane_tests():
    import re
    import tomllib

    from conftest import REPO

    tpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    lane = re.search(r"^XLA_REQ\s*:=\s*(.+)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    assert sorted(re.sub(r"\[tpu\]", "", r) for r in tpu) == sorted(lane)
