"""Launcher detection is pure: environments in, ClusterEnv out."""

import pytest

from podtrain.distributed.env import ClusterEnv, expand_nodelist, slurm_port
from podtrain.distributed.group import resolve_backend
from podtrain.errors import UserError


def test_torchrun_variables():
    env = ClusterEnv.detect({"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                             "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29400",
                             "PODTRAIN_HOSTNAME": "node-b"})
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.node_rank) == ("torchrun", 5, 1, 8, 1)
    assert (env.master_addr, env.master_port, env.num_nodes, env.hostname) == ("10.0.0.7", 29400, 2, "node-b")


def test_srun_variables_take_the_first_host_of_a_ranged_nodelist():
    env = ClusterEnv.detect({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
                             "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "4242",
                             "SLURM_JOB_NODELIST": "p5-[001-004,010]", "SLURM_NTASKS_PER_NODE": "2(x4)"})
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.node_rank) == ("srun", 3, 1, 8, 1)
    assert env.master_addr == "p5-001"
    assert env.local_world_size == 2
    assert env.master_port == slurm_port("4242") == 24242


def test_no_launcher_is_a_single_process():
    env = ClusterEnv.detect({})
    assert (env.launcher, env.rank, env.world_size, env.is_distributed) == ("single", 0, 1, False)


@pytest.mark.parametrize("text, hosts", [
    ("p5-[001-004,010]", ["p5-001", "p5-002", "p5-003", "p5-004", "p5-010"]),
    ("gpu7,gpu9", ["gpu7", "gpu9"]),
    ("a[8-10],b1", ["a8", "a9", "a10", "b1"]),
    ("r[1-2]-n[3-4]", ["r1-n3", "r1-n4", "r2-n3", "r2-n4"]),
    ("single", ["single"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("bad", ["p5-[001-004", "p5-[4-1]", "p5-]1["])
def test_bad_nodelists_are_user_errors(bad):
    with pytest.raises(UserError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad)


def test_inconsistent_rank_is_named():
    with pytest.raises(UserError, match="RANK=4 and WORLD_SIZE=4 disagree"):
        ClusterEnv.detect({"RANK": "4", "WORLD_SIZE": "4"})


def test_backend_auto():
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(UserError, match="needs CUDA"):
        resolve_backend("nccl", cuda_available=False)


def test_the_file_descriptor_limit_is_raised_or_named_before_any_group_is_made():
    """512 ranks on CPU (gloo main group) with a local tier: rank 0 roots 3 lazily connected side
    groups (~2,000 sockets), the others hold a handful in each: raised toward the hard limit when
    it allows, else one line naming the limit and the host."""
    import pytest

    from podtrain.distributed import fd_limit
    from podtrain.errors import UserError

    side = fd_limit.side_groups(local_tier=True, main_backend="gloo")
    assert side == 3 and fd_limit.side_groups(local_tier=False, main_backend="nccl") == 2
    root = fd_limit.sockets_needed(512, 0, side, main_gloo=True)
    other = fd_limit.sockets_needed(512, 7, side, main_gloo=True)
    assert root == 4 * 511 + fd_limit.MARGIN
    assert other == 511 + 3 * fd_limit.side_peers(512) + fd_limit.MARGIN and fd_limit.side_peers(512) == 26
    assert fd_limit.sockets_needed(512, 7, 2, main_gloo=False) < 600  # NCCL ranks other than 0: no mesh at all
    assert fd_limit.ensure(fd_limit.sockets_needed(2, 0, side, True), "h", limits=(1024, 4096)) == 1024  # untouched
    assert fd_limit.ensure(root, "h", limits=(1024, 1 << 20)) == 2 * root  # raised, within the hard limit
    with pytest.raises(UserError, match=r"needs ~2556 file descriptors .* limit on host node-9 is 1024 \(hard 1024\)"):
        fd_limit.ensure(root, "node-9", limits=(1024, 1024))


def _side_group_sockets(rank, world):
    """Descriptors one eager gloo group and one side group cost this rank, each after the
    collectives podtrain runs on side groups (all_reduce, all_gather, gather and broadcast to/from
    rank 0, sends to ring neighbours)."""
    import torch
    import torch.distributed as dist

    from podtrain.distributed.side_group import new_side_group, open_sockets

    def cost(make):
        before = open_sockets()
        group = make()
        flag = torch.ones(1)
        dist.all_reduce(flag, group=group)
        out = [None] * world
        dist.all_gather_object(out, rank, group=group)
        dist.gather_object(rank, out if rank == 0 else None, dst=0, group=group)
        box = [rank]
        dist.broadcast_object_list(box, src=0, group=group)
        reqs = [dist.isend(flag, (rank + 1) % world, group=group), dist.irecv(torch.ones(1), (rank - 1) % world, group=group)]
        for req in reqs:
            req.wait()
        return open_sockets() - before

    return cost(lambda: dist.new_group(backend="gloo")), cost(new_side_group)


@pytest.mark.slow
def test_side_groups_connect_lazily_so_ranks_other_than_0_hold_a_few_sockets_not_one_per_peer():
    """Real gloo groups over 12 forked ranks: an eager group costs every rank one socket per peer;
    a side group costs rank 0 one per peer and every other rank at most ``side_peers``."""
    from multirank import run_ranks
    from podtrain.distributed import fd_limit

    world = 12
    costs = run_ranks(_side_group_sockets, world)
    assert all(eager >= world - 1 for eager, _ in costs), costs
    assert all(side <= fd_limit.side_peers(world) and side < world - 1 for _, side in costs[1:]), costs
