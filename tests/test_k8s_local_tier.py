"""``podtrain launch k8s`` and the node-local checkpoint tier (``ckpt.local_dir``): the node's NVMe
mounted through ``--local-tier-host-path`` (a hostPath volume), the refusal of a local tier on no
volume of the pod (the container's own filesystem), and the size check against a volume's limit
(the memory-backed ``/dev/shm``) at the planner's checkpoint size. Every manifest generated here is
validated against the PyTorchJob CRD, HyperPod's model and the core Kubernetes pod schema.
"""

from __future__ import annotations

import pytest
import yaml

from podtrain.cli import main
from podtrain.launch import k8s, schemas
from test_launch_k8s import DEMO, IMAGE, check_pytorchjob, generate

NVME = "/opt/dlami/nvme/podtrain"
LOCAL = ("ckpt.local_every=10",)
# The demo's tiny model: 1,832,640 parameters; the planner's checkpoint is 12 bytes each (fp32
# weights 4 + AdamW's two moments 8): 21,991,680 bytes = 20.97 MiB. ckpt.local_keep 2 plus the
# step being written: 3 x 20.97 MiB = 65,975,040 bytes = 62.9 MiB on one node.
TINY_LOCAL_TIER_BYTES = 3 * 12 * 1_832_640


def refused(tmp_path, capsys, *args: str) -> str:
    """Run `podtrain launch k8s` expecting exit 2: its one line, after checking nothing was written."""
    out = tmp_path / "job.yaml"
    code = main(["launch", "k8s", DEMO, "train.micro_batch_size=4", "train.global_batch_size=64",
                 *[a for a in args if "=" in a], *[a for a in args if "=" not in a], "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("podtrain: error: "), err
    assert "Traceback" not in err and not out.exists()
    return err.strip()


def pod_of(job: dict) -> dict:
    return k8s.job_pod_template(job)["spec"]


def test_host_path_mounts_the_nodes_nvme_at_the_local_dir_in_both_kinds(tmp_path, capsys):
    crd = k8s.crd_schema(k8s.CRD_FILE)
    for kind in k8s.KINDS:
        config_map, job = generate(tmp_path, "--kind", kind, "--nodes", "2", "--gpus-per-node", "8",
                                   "--image", IMAGE, "--pvc", "fsx", "--local-tier-host-path", NVME,
                                   overrides=("ckpt.local_dir=/local/podtrain", *LOCAL))
        if kind == "pytorchjob":
            check_pytorchjob(job, crd)
        else:
            schemas.validate_hyperpodpytorchjob(job)
            k8s.validate_pod_template(k8s.job_pod_template(job))
        pod = pod_of(job)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["local-tier"] == {"name": "local-tier",
                                         "hostPath": {"path": NVME, "type": "DirectoryOrCreate"}}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert mounts["local-tier"] == {"name": "local-tier", "mountPath": "/local/podtrain"}
        # The config the pods read keeps the path it was given: the mount is where it points.
        assert yaml.safe_load(config_map["data"]["config.yaml"])["ckpt"]["local_dir"] == "/local/podtrain"
        err = capsys.readouterr().err
        assert ("podtrain: ckpt.local_dir in the pods: /local/podtrain (on /local/podtrain, hostPath "
                f"{NVME} of the node: kept across pod restarts on that node, lost with the node") in err, err


def test_a_local_dir_with_a_variable_is_mounted_at_its_fixed_part(tmp_path, capsys):
    _, job = generate(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE,
                      "--local-tier-host-path", NVME, overrides=("ckpt.local_dir=/local/${RUN}/x", *LOCAL))
    check_pytorchjob(job, k8s.crd_schema(k8s.CRD_FILE))
    mounts = {m["name"]: m["mountPath"] for m in pod_of(job)["containers"][0]["volumeMounts"]}
    assert mounts == {"shm": "/dev/shm", "podtrain-config": "/etc/podtrain", "local-tier": "/local"}


def test_a_local_dir_on_no_volume_is_refused_saying_what_survives_what(tmp_path, capsys):
    err = refused(tmp_path, capsys, "--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx",
                  "ckpt.local_dir=/nvme/podtrain", *LOCAL)
    assert err.startswith("podtrain: error: config key 'ckpt.local_dir' /nvme/podtrain is on none of the "
                          "pod's volumes (/dev/shm (memory-backed emptyDir shm), /etc/podtrain (ConfigMap "
                          "podtrain-demo-config), /fsx (claim fsx)): it would be the container's own "
                          "filesystem, which survives only torchrun's restarts inside the container and is "
                          "discarded when the container restarts or the pod is replaced"), err
    assert "--local-tier-host-path (e.g. /opt/dlami/nvme/podtrain" in err and "under /dev/shm" in err
    # A relative path would be in the container's working directory: refused, naming it.
    err = refused(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE,
                  "ckpt.local_dir=local/tier", *LOCAL)
    assert "config key 'ckpt.local_dir' local/tier is relative" in err and "/dev/shm (memory-backed" in err
    # The ConfigMap's mount is read-only.
    err = refused(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE,
                  "ckpt.local_dir=/etc/podtrain/tier", *LOCAL)
    assert "config key 'ckpt.local_dir' /etc/podtrain/tier is on the pod's read-only /etc/podtrain" in err


def test_a_local_dir_on_a_mounted_volume_is_accepted(tmp_path, capsys):
    crd = k8s.crd_schema(k8s.CRD_FILE)
    _, job = generate(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE,
                      overrides=("ckpt.local_dir=/dev/shm/podtrain", *LOCAL))
    check_pytorchjob(job, crd)
    assert "local-tier" not in {v["name"] for v in pod_of(job)["volumes"]}
    err = capsys.readouterr().err
    assert ("podtrain: ckpt.local_dir in the pods: /dev/shm/podtrain (on /dev/shm, memory-backed emptyDir "
            "shm: kept across container restarts, lost when the pod is deleted or replaced)") in err, err
    # On the shared claim it works, and says it is not node-local.
    _, job = generate(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx",
                      overrides=("ckpt.local_dir=/fsx/local", *LOCAL))
    check_pytorchjob(job, crd)
    assert "ckpt.local_dir in the pods: /fsx/local (on /fsx, claim fsx: shared storage, not node-local" in \
        capsys.readouterr().err


def test_the_local_tier_must_fit_the_memory_backed_dev_shm(tmp_path, capsys):
    shm = ("ckpt.local_dir=/dev/shm/podtrain", *LOCAL)
    need_mib = TINY_LOCAL_TIER_BYTES / 2**20  # 62.92
    err = refused(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE,
                  "--shm-size", "62Mi", *shm)
    assert err == (
        "podtrain: error: config key 'ckpt.local_dir' /dev/shm/podtrain is on the pod's /dev/shm "
        "(memory-backed emptyDir shm, --shm-size 62Mi = 62.0 MiB), too small for the local tier: it holds "
        f"{need_mib:.1f} MiB per node (ckpt.local_keep 2 + the step being written = 3 steps x 1 (own pieces, "
        "no peer replica) x 21.0 MiB: the planner's 21.0 MiB checkpoint of 1,832,640 parameters over 1 node); "
        "give --shm-size 63Mi or more, or put the tier on the node's NVMe (--local-tier-host-path)"), err
    # 63 MiB holds the 62.9 MiB: accepted, and the manifest validates.
    _, job = generate(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--shm-size", "63Mi",
                      overrides=shm)
    check_pytorchjob(job, k8s.crd_schema(k8s.CRD_FILE))
    assert {v["name"]: v for v in pod_of(job)["volumes"]}["shm"]["emptyDir"]["sizeLimit"] == "63Mi"
    # ckpt.local_keep 1 holds two steps: 42 MiB fit in 50Mi.
    generate(tmp_path, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--shm-size", "50Mi",
             overrides=(*shm, "ckpt.local_keep=1"))


def test_the_size_check_counts_the_nodes_share_and_its_peer_replicas(tmp_path, capsys):
    # llama-8b: 8,030,261,248 parameters x 12 bytes = 89.75 GiB; over 4 nodes 22.44 GiB each, twice
    # (own pieces and one peer's replica), 3 steps: 134.6 GiB, far beyond the default 32Gi. The
    # model is counted with the preset's own vocabulary: data.path names no prepared data (the demo
    # config's data/builtin, once `make demo` has prepared it, would give the byte vocabulary).
    llama = ("model.preset=llama-8b", "train.micro_batch_size=1", "train.global_batch_size=32",
             f"data.path={tmp_path / 'not-prepared'}",
             "ckpt.local_dir=/dev/shm/podtrain", *LOCAL)
    job = ("--nodes", "4", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx")
    err = refused(tmp_path, capsys, *job, *llama)
    share = 12 * 8_030_261_248 / 4 / 2**30
    assert (f"--shm-size 32Gi = 32.0 GiB), too small for the local tier: it holds {3 * 2 * share:.1f} GiB per "
            "node (ckpt.local_keep 2 + the step being written = 3 steps x 2 (own pieces + 1 peer replica "
            f"(ckpt.local_replicas)) x {share:.1f} GiB: the planner's 89.7 GiB checkpoint of 8,030,261,248 "
            "parameters over 4 nodes); give --shm-size 135Gi or more") in err, err
    # An elastic job may shrink to --min-nodes: each node's share is then larger.
    err = refused(tmp_path, capsys, *job, "--min-nodes", "2", "--shm-size", "135Gi", *llama,
                  "train.global_batch_size=96")  # divides over 2, 3 and 4 nodes
    assert f"it holds {3 * 2 * 2 * share:.1f} GiB per node" in err and "over 2 nodes" in err, err
    assert "give --shm-size 270Gi or more" in err, err
    # No replicas: 67.3 GiB fit in 68Gi.
    generate(tmp_path, *job, "--shm-size", "68Gi", overrides=(*llama, "ckpt.local_replicas=0"))
    # On the node's NVMe there is no limit to check (the disk is the user's to size).
    generate(tmp_path, *job, "--local-tier-host-path", NVME, overrides=(*llama[:3], "ckpt.local_dir=/local",
                                                                         *LOCAL))


BAD_HOST_PATH = [
    ((), "--local-tier-host-path /opt/dlami/nvme/podtrain needs the local tier on: set ckpt.local_dir"),
    (("ckpt.local_dir=/local", *LOCAL, "--local-tier-host-path", "nvme"),
     "--local-tier-host-path nvme must be an absolute path on the node without '..'"),
    (("ckpt.local_dir=/local", *LOCAL, "--local-tier-host-path", "/opt/../etc"),
     "--local-tier-host-path /opt/../etc must be an absolute path on the node without '..'"),
    (("ckpt.local_dir=/dev/shm", *LOCAL), "config key 'ckpt.local_dir' /dev/shm is the pod's /dev/shm mount"),
    (("ckpt.local_dir=/etc/podtrain/t", *LOCAL),
     "config key 'ckpt.local_dir' /etc/podtrain/t is the pod's read-only /etc/podtrain mount"),
    (("ckpt.local_dir=/${NODE}/t", *LOCAL), "config key 'ckpt.local_dir' /${NODE}/t gives no directory"),
    (("ckpt.local_dir=/usr", *LOCAL), "config key 'ckpt.local_dir' /usr would mount it over the image's /usr"),
    (("ckpt.local_dir=/etc", *LOCAL), "config key 'ckpt.local_dir' /etc would mount it over the image's /etc"),
]


@pytest.mark.parametrize("flags,message", BAD_HOST_PATH, ids=[m for _, m in BAD_HOST_PATH])
def test_a_host_path_that_cannot_be_mounted_is_one_line(tmp_path, capsys, flags, message):
    if "--local-tier-host-path" not in flags:
        flags = (*flags, "--local-tier-host-path", NVME)
    err = refused(tmp_path, capsys, "--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, *flags)
    assert message in err, err


def test_kubernetes_quantities_in_bytes():
    from podtrain.launch.k8s_names import quantity_bytes

    assert [quantity_bytes(q) for q in ("32Gi", "500M", "1.5Gi", ".5Ki", "100", "2k", "1Ti")] == \
        [32 * 2**30, 500 * 10**6, 3 * 2**29, 512, 100, 2000, 2**40]
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity_bytes("lots")
