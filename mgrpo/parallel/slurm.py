"""The rendezvous arithmetic of launch/slurm/train_grpo.sbatch, in Python so that it is tested: which of the job's
nodes train and which serve rollouts, the master address, node and process counts, the rollout server URLs.

    python -m mgrpo.parallel.slurm --hosts "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)" \
        --rollout-nodes 1 --gpus-per-node 8          # prints shell assignments for the batch script to eval

`expand_nodelist` expands Slurm's compressed form (`gpu[01-02,7],a1`) the way `scontrol show hostnames` does,
for machines without scontrol and for the tests.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys


class SlurmPlanError(ValueError):
    pass


def _split_top(nodelist: str) -> list:
    """Split on commas outside brackets: 'a[1,3],b' -> ['a[1,3]', 'b']."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SlurmPlanError(f"node list {nodelist!r}: unbalanced brackets")
    return parts + [cur] if cur else parts


def _expand_one(item: str) -> list:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    head, tail, out = item[: m.start()], item[m.end() :], []
    for rng in m.group(1).split(","):
        lo, _, hi = rng.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SlurmPlanError(f"node list item {item!r}: {rng!r} is not a number or a range like 01-04")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out += _expand_one(f"{head}{n:0{width}d}{tail}")  # zero padding as written; several brackets nest
    return out


def expand_nodelist(nodelist: str) -> list:
    """'gpu[01-02],a1,b7' -> ['gpu01', 'gpu02', 'a1', 'b7'] (order kept, as scontrol show hostnames)."""
    hosts = [h for part in _split_top(nodelist.strip()) if part for h in _expand_one(part.strip())]
    if not hosts:
        raise SlurmPlanError(f"node list {nodelist!r} names no host")
    return hosts


def plan_nodes(
    hosts: list, rollout_nodes: int = 0, gpus_per_node: int = 8, master_port: int = 29500, rollout_port: int = 8000
) -> dict:
    """The first nodes train (the first of them is the rendezvous master); the last `rollout_nodes` run one
    rollout server each."""
    if rollout_nodes < 0 or rollout_nodes >= len(hosts):
        raise SlurmPlanError(
            f"ROLLOUT_NODES={rollout_nodes} leaves no training node among the job's {len(hosts)} "
            f"node(s) ({', '.join(hosts)}); ask for more nodes (#SBATCH --nodes) or fewer "
            f"rollout nodes"
        )
    if gpus_per_node < 1:
        raise SlurmPlanError(f"GPUS_PER_NODE={gpus_per_node}: give the processes to start per training node")
    train, rollout = hosts[: len(hosts) - rollout_nodes], hosts[len(hosts) - rollout_nodes :]
    return dict(
        TRAIN_HOSTS=",".join(train),
        ROLLOUT_HOSTS=",".join(rollout),
        MASTER_ADDR=train[0],
        MASTER_PORT=master_port,
        NNODES=len(train),
        NPROC_PER_NODE=gpus_per_node,
        WORLD_SIZE=len(train) * gpus_per_node,
        SERVER_URLS=",".join(f"https://{h}:{rollout_port}" for h in rollout),
    )  # off-host: TLS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Slurm rendezvous plan for launch/slurm/train_grpo.sbatch")
    ap.add_argument("--hosts", required=True, help="comma-separated hosts or a Slurm node list (gpu[01-04])")
    ap.add_argument("--rollout-nodes", type=int, default=0)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--rollout-port", type=int, default=8000)
    a = ap.parse_args(argv)
    try:
        plan = plan_nodes(expand_nodelist(a.hosts), a.rollout_nodes, a.gpus_per_node, a.master_port, a.rollout_port)
    except SlurmPlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for k, v in plan.items():
        print(f"{k}={shlex.quote(str(v))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
