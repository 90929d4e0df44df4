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
    """512 ranks x 3 gloo groups need ~2,000 sockets per rank: raised toward the hard limit when
    it allows, else one line naming the limit and the host."""
    import pytest

    from podtrain.distributed import fd_limit
    from podtrain.errors import UserError

    need = fd_limit.sockets_needed(512, fd_limit.gloo_groups(local_tier=True))
    assert need == 3 * 511 + fd_limit.MARGIN
    assert fd_limit.ensure(2, 3, "h", limits=(1024, 4096)) == 1024  # small jobs: untouched
    assert fd_limit.ensure(512, 3, "h", limits=(1024, 1 << 20)) == 2 * need  # raised, within the hard limit
    with pytest.raises(UserError, match=r"needs ~2045 file descriptors .* limit on host node-9 is 1024 \(hard 1024\)"):
        fd_limit.ensure(512, 3, "node-9", limits=(1024, 1024))
