"""The Slurm rendezvous arithmetic with synthetic multi-node node lists, and launch/slurm/train_grpo.sbatch driven
by stand-in `scontrol` and `srun` commands that record what the script asks of them (the real Slurm run is
tests/test_slurm_job.py, marked slurm)."""

import os
import stat
import subprocess

import pytest

from mgrpo.parallel.slurm import SlurmPlanError, expand_nodelist, plan_nodes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu[01-02]", ["gpu01", "gpu02"]),
        ("a1,b7", ["a1", "b7"]),
        ("node[003-005,7],gpu1", ["node003", "node004", "node005", "node7", "gpu1"]),
        ("rack[1-2]-n[08-09]", ["rack1-n08", "rack1-n09", "rack2-n08", "rack2-n09"]),
        ("single", ["single"]),
    ],
)
def test_node_lists_expand_like_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu[a-b]", ""])
def test_a_bad_node_list_is_one_clear_error(bad):
    with pytest.raises(SlurmPlanError):
        expand_nodelist(bad)


def test_training_nodes_first_rollout_nodes_last():
    plan = plan_nodes(expand_nodelist("gpu[01-04]"), rollout_nodes=1, gpus_per_node=8, rollout_port=8100)
    assert plan["TRAIN_HOSTS"] == "gpu01,gpu02,gpu03" and plan["MASTER_ADDR"] == "gpu01"
    assert plan["NNODES"] == 3 and plan["WORLD_SIZE"] == 24 and plan["ROLLOUT_HOSTS"] == "gpu04"
    assert plan["SERVER_URLS"] == "https://gpu04:8100"  # off loopback: TLS
    plan = plan_nodes(["a1", "b7"], rollout_nodes=0, gpus_per_node=4)
    assert (plan["NNODES"], plan["WORLD_SIZE"], plan["SERVER_URLS"]) == (2, 8, "")
    with pytest.raises(SlurmPlanError, match="leaves no training node"):
        plan_nodes(["a1", "b7"], rollout_nodes=2)


FAKE_SCONTROL = """#!/bin/bash
# stand-in: `scontrol show hostnames LIST` via the tested expansion; `scontrol requeue` recorded
if [ "$1" = show ]; then exec {py} -c "import sys; from mgrpo.parallel.slurm import expand_nodelist; print('\\n'.join(expand_nodelist(sys.argv[1])))" "$3"; fi
echo "scontrol $*" >> {log}
"""
FAKE_SRUN = """#!/bin/bash
# stand-in: records its command line; a rollout server's step writes `ready:` to its --output file
echo "srun $*" >> {log}
out=""
while [ $# -gt 0 ]; do case "$1" in --output) out=$2; shift 2;; --*) [[ "$2" == -* || "$1" == *=* ]] && shift || shift 2;; *) break;; esac; done
case "$*" in *rollout_server.py*) echo "ready: http://x:8000" > "$out"; exec sleep 5;; esac
exit 0
"""


def run_sbatch(tmp_path, **env):
    import sys

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir(parents=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        path = bin_dir / name
        path.write_text(text.format(py=sys.executable, log=log))
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    full.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_SUBMIT_DIR=ROOT,
        SLURM_JOB_ID="77",
        LOG_DIR=str(tmp_path / "logs"),
        PYTHONPATH=ROOT,
        **env,
    )
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "launch", "slurm", "train_grpo.sbatch")],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, (log.read_text() if log.exists() else "")


def test_the_batch_script_starts_servers_then_one_torchrun_per_training_node(tmp_path):
    proc, calls = run_sbatch(
        tmp_path,
        SLURM_JOB_NODELIST="gpu[01-03]",
        GPUS_PER_NODE="8",
        ROLLOUT_NODES="1",
        ROLLOUT_MODEL="/models/m",
        SLURM_RESTART_COUNT="1",
        ROLLOUT_SSL_CERT="/tls/cert.pem",
        ROLLOUT_SSL_KEY="/tls/key.pem",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = calls.splitlines()
    server = next(line for line in lines if "rollout_server.py" in line)
    assert "--nodelist gpu03" in server and "--model /models/m --host 0.0.0.0 --port 8000" in server
    assert "--ssl-certfile /tls/cert.pem --ssl-keyfile /tls/key.pem" in server  # off loopback: TLS
    train = next(line for line in lines if "train_grpo.py" in line)
    assert "--nodes 2 --ntasks 2 --ntasks-per-node 1 --nodelist gpu01,gpu02" in train
    assert "--nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint gpu01:29500 --rdzv-id 77" in train
    assert (
        "--rollout.engine remote --rollout.servers https://gpu03:8000 --rollout.remote.ca_file /tls/cert.pem" in train
    )
    assert train.rstrip().endswith("--resume")  # SLURM_RESTART_COUNT=1: a requeued run continues
    assert "MGRPO_SERVER_TOKEN" not in proc.stdout + proc.stderr + calls  # never printed


def test_the_batch_script_refuses_a_plan_without_training_nodes(tmp_path):
    proc, calls = run_sbatch(tmp_path, SLURM_JOB_NODELIST="a1,b7", ROLLOUT_NODES="2", ROLLOUT_MODEL="/m")
    assert proc.returncode == 2 and "ROLLOUT_NODES=2 leaves no training node" in proc.stderr
    assert "srun" not in calls
    proc, _ = run_sbatch(tmp_path / "x", SLURM_JOB_NODELIST="a1,b7", ROLLOUT_NODES="1")
    assert proc.returncode == 2 and "needs ROLLOUT_MODEL" in proc.stderr
    proc, _ = run_sbatch(tmp_path / "y", SLURM_JOB_NODELIST="a1,b7", ROLLOUT_NODES="1", ROLLOUT_MODEL="/m")
    assert proc.returncode == 2 and "needs ROLLOUT_SSL_CERT and ROLLOUT_SSL_KEY" in proc.stderr
