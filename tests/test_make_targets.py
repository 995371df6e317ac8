"""The Makefile as README's two machine paths use it: a TPU VM's uv venv is refreshed with uv and the
tpu extra, never rebuilt with pip or another torch; one host's share is staged only with the config
and the host named; torchrun spans nodes from make variables (what a second GPU node, and the
rehearsal's second host, run)."""
import shutil
import subprocess

from conftest import REPO


def make_n(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-n", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_a_tpu_venv_is_refreshed_by_uv_with_its_own_torch(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed").touch()
    (venv / ".tpu").touch()                    # what make venv-tpu leaves
    tpu = make_n("-W", "pyproject.toml", "venv", f"VENV={venv}", "UV=/opt/uv").stdout   # pyproject.toml changed
    assert "/opt/uv pip install -q --python" in tpu and "'.[tpu,test]'" in tpu
    assert "torch==2.13.0" not in tpu and "-m pip" not in tpu and "-m venv" not in tpu
    (venv / ".tpu").unlink()
    plain = make_n("-W", "pyproject.toml", "venv", f"VENV={venv}").stdout
    assert "torch==2.13.0" in plain and "-m pip install -q -e '.[test,bench]'" in plain
    made = make_n("venv-tpu", f"VENV={tmp_path / 'fresh'}", "UV=/opt/uv").stdout
    assert "/opt/uv venv --python 3.11" in made and "touch" in made and "'.[tpu,test]'" in made


def test_staging_a_share_needs_the_host_and_the_config(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    r = subprocess.run(["make", "-s", "stage", "HOSTS=4", "HOST=1"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "set HOST=<this host, 0 to HOSTS-1> and CONFIG=" in r.stderr
    assert not (tmp_path / ".venv").exists()
    share = make_n("-s", "stage", "CACHE=gs://b/c", "LOCAL=/mnt/x", "HOSTS=4", "HOST=1", "CONFIG=p.yaml",
                   "ARGS=data.scanners=[a]").stdout
    assert "-m train.shares --config p.yaml --host 1 --hosts 4" in share and "data.scanners=[a]" in share
    assert "-m cache.stage" in make_n("-s", "stage", "CACHE=gs://b/c", "LOCAL=/mnt/x").stdout


def test_torchrun_spans_nodes_from_make_variables():
    two = make_n("-s", "pretrain", "CONFIG=p.yaml", "NNODES=2", "NODE_RANK=1", "MASTER_ADDR=10.0.0.2",
                 "MASTER_PORT=29400").stdout
    assert ("torch.distributed.run --nnodes 2 --node_rank 1 --master_addr 10.0.0.2 --master_port 29400 "
            "--nproc_per_node 1 -m train.pretrain") in two
    one = make_n("-s", "pretrain", "CONFIG=p.yaml", "NPROC=8").stdout
    assert "torch.distributed.run  --nproc_per_node 8" in one and "--nnodes" not in one
    assert "torch.distributed.run" not in make_n("-s", "pretrain", "CONFIG=p.yaml").stdout
