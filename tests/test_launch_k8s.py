"""``podtrain launch k8s``: manifests checked against the PyTorchJob CRD schema (unknown fields
rejected) and the core Kubernetes schema (offline), bad input, and the worker command from the
manifest run here, two "pods" with the environment the training operator gives them.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cluster_fixtures import TINY_TRAINING, free_port, prepare_data, read_metrics
from podtrain.ckpt import layout
from podtrain.ckpt.reader import verify
from podtrain.cli import main
from podtrain.config import load_config
import podtrain
from podtrain.errors import UserError
from podtrain.launch import agent, k8s, schemas, torchrun

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")
CRD = k8s.CRD_FILE  # shipped in the package: these tests need nothing outside the repository
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/podtrain:0.1.0"


@pytest.fixture(scope="module")
def crd_schema():
    """The PyTorchJob CRD's openAPIV3Schema, from the copy inside the package."""
    return k8s.crd_schema(CRD)


def generate(tmp_path: Path, *flags: str, overrides: tuple[str, ...] = ()) -> list[dict]:
    """Run `podtrain launch k8s` into a file and return its YAML documents."""
    out = tmp_path / "job.yaml"
    assert main(["launch", "k8s", DEMO, "train.micro_batch_size=4", "train.global_batch_size=64",
                 *overrides, "--output", str(out), *flags]) == 0
    return list(yaml.safe_load_all(out.read_text()))


def check_pytorchjob(job: dict, schema: dict) -> None:
    """CRD schema, unknown fields, and the pod template against core Kubernetes."""
    import jsonschema

    jsonschema.Draft4Validator(schema).validate(job)
    assert k8s.unknown_fields(job, schema) == []
    k8s.validate_pytorchjob(job, CRD)
    k8s.validate_pod_template(k8s.job_pod_template(job))


def test_pytorchjob_for_p5_on_hyperpod(tmp_path, crd_schema):
    config_map, job = generate(tmp_path, "--nodes", "4", "--instance-type", "p5.48xlarge",
                               "--image", IMAGE, "--pvc", "fsx-claim", "--mount", "/fsx",
                               "--hyperpod-auto-resume", "--max-retry", "5",
                               overrides=("train.global_batch_size=128",))
    check_pytorchjob(job, crd_schema)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["namespace"] == "kubeflow"
    assert job["metadata"]["annotations"] == {
        "sagemaker.amazonaws.com/enable-job-auto-resume": "true",
        "sagemaker.amazonaws.com/job-max-retry-count": "5"}
    policy = job["spec"]["elasticPolicy"]
    assert (policy["rdzvBackend"], policy["minReplicas"], policy["maxReplicas"]) == ("c10d", 4, 4)
    assert policy["maxRestarts"] == 3 and job["spec"]["nprocPerNode"] == "8"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "OnFailure"
    pod = worker["template"]["spec"]
    (container,) = pod["containers"]
    # 90% of a p5's EKS allocatable (test_pod_requests_fit_the_nodes_eks_allocatable), requests
    # equal to limits: a Guaranteed pod, which the kubelet evicts last.
    assert container["resources"]["limits"] == {
        "nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32, "cpu": "172", "hugepages-2Mi": "5120Mi",
        "memory": "1694Gi"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    # Nodes tainted for their GPUs and EFA devices take the pod.
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "vpc.amazonaws.com/efa", "operator": "Exists", "effect": "NoSchedule"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == "/fsx/runs/demo/debug/nccl_trace_rank_"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["shm"] == "/dev/shm" and mounts["shared"] == "/fsx"
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "ml.p5.48xlarge"}
    # The agent is the container's PID 1 around torchrun; it adds torchrun's --shutdown-timeout
    # (ckpt.grace_s, 120 s) where the image's torch has it. Kubernetes waits longer than that
    # before it SIGKILLs the container.
    script = container["command"][-1]
    assert "exec python3 -m podtrain.launch.agent python3 -m torch.distributed.run " in script
    assert "--shutdown-timeout" not in script
    assert script.rstrip().endswith('-m podtrain.cli train "$PODTRAIN_CONFIG"')
    assert pod["terminationGracePeriodSeconds"] == 135
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "sagemaker.amazonaws.com/node-health-status", "operator": "In",
         "values": ["Schedulable"]}]
    # The validated config travels in the ConfigMap; run.dir lives on the shared claim.
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(config_map["data"]["config.yaml"])
    cfg = load_config(cfg_file)
    assert cfg.run.dir == "/fsx/runs/demo" and cfg.data.path == "/fsx/data/builtin"
    assert config_map["metadata"]["name"] == volumes["podtrain-config"]["configMap"]["name"]


def test_pod_requests_fit_the_nodes_eks_allocatable():
    from podtrain.launch.instances import (INSTANCE_TYPES, POD_SHARE, efa_share, eks_allocatable, lookup,
                                           pod_resources)

    # p5.48xlarge by hand: 192 vCPUs less kube-reserved 60 + 10 + 2 x 5 + 188 x 2.5 = 550 m; 2048 GiB
    # less the 7.5% the kubelet never sees, the EFA installer's 5128 huge pages of 2 MiB, kube-reserved
    # 11 x 100 pods + 255 MiB and the 100 MiB eviction threshold.
    p5 = eks_allocatable(lookup("p5.48xlarge"))
    assert (p5.cpu_millicores, p5.hugepages_2mi_mib) == (192000 - 550, 10256)
    assert p5.memory_mib == int(2048 * 1024 * 0.925) - 10256 - (11 * 100 + 255) - 100 == 1928154
    for name, instance in INSTANCE_TYPES.items():
        node = eks_allocatable(instance)
        for gpus in (g for g in range(1, instance.gpus + 1) if instance.gpus % g == 0):
            efa = efa_share(instance, gpus)
            # Pods of this size on one node: all of them, unless each needs more than its share of
            # EFA devices (a 1-GPU pod on a p4d, 4 devices for 8 GPUs, still gets one).
            pods = min(instance.gpus // gpus, instance.efa // efa)
            if instance.efa >= instance.gpus:
                assert pods == instance.gpus // gpus, (name, gpus)
            asked = pod_resources(instance, gpus, efa)
            cpu_m = int(asked["cpu"]) * 1000
            memory_mib = int(asked["memory"].removesuffix("Gi")) * 1024
            # They fit together, with the rest of the allocatable left to the DaemonSets.
            assert pods * cpu_m <= POD_SHARE * node.cpu_millicores, (name, gpus, asked)
            assert pods * memory_mib <= POD_SHARE * node.memory_mib, (name, gpus, asked)
            assert pods * int(asked["hugepages-2Mi"].removesuffix("Mi")) <= node.hugepages_2mi_mib, (name, gpus)
            assert memory_mib >= 0.85 * node.memory_mib * gpus / instance.gpus  # and not far below
    # The docs' table (docs/clusters.md) is these numbers.
    readme = (REPO / "docs/clusters.md").read_text()
    rows = re.findall(r"^\| ([a-z0-9.-]+)[^|]* \| [^|]+ \| [^|]+ \| ([\d.]+) / (\d+) GiB \| (\d+) CPU, (\d+Gi), "
                      r"(\d+Mi) huge pages \|$", readme, re.M)
    assert len(rows) == 3, rows
    for name, cpu, memory, pod_cpu, pod_memory, hugepages in rows:
        instance = lookup(name)
        node = eks_allocatable(instance)
        assert (float(cpu), int(memory)) == (node.cpu_millicores / 1000, round(node.memory_mib / 1024)), name
        assert pod_resources(instance, 8, instance.efa) == {
            "cpu": pod_cpu, "hugepages-2Mi": hugepages, "memory": pod_memory}, name
    # A p5 pod with 2 of the 8 GPUs: 8 of the 32 EFA devices and a quarter of the huge pages.
    assert efa_share(lookup("p5.48xlarge"), 2) == 8
    assert pod_resources(lookup("p5.48xlarge"), 2, 8)["hugepages-2Mi"] == "2564Mi"


def test_cpu_pytorchjob_without_gpus(tmp_path, crd_schema):
    _, job = generate(tmp_path, "--nodes", "2", "--min-nodes", "1", "--gpus-per-node", "0",
                      "--nproc-per-node", "2", "--image", IMAGE, "--pvc", "shared",
                      overrides=("train.global_batch_size=16",))
    check_pytorchjob(job, crd_schema)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert "resources" not in pod["containers"][0] and "affinity" not in pod
    assert "tolerations" not in pod  # no device requested: no device taint tolerated
    assert job["spec"]["elasticPolicy"]["minReplicas"] == 1
    assert "annotations" not in job["metadata"]
    # without HyperPod: a user mistake (exit 2) is not retried, a preemption (143) is
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"


def test_schema_checks_catch_misspelt_and_mistyped_fields(tmp_path, crd_schema):
    _, job = generate(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE,
                      "--pvc", "fsx")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["elasticPolicy"]["nprocPerNode"] = 8  # the CRD spells it nProcPerNode
    assert k8s.unknown_fields(misspelt, crd_schema) == ["spec.elasticPolicy.nprocPerNode"]
    with pytest.raises(ValueError, match="fields its schema does not know"):
        k8s.validate_pytorchjob(misspelt, CRD)
    mistyped = copy.deepcopy(job)
    mistyped["spec"]["elasticPolicy"]["maxRestarts"] = "3"
    with pytest.raises(ValueError, match="maxRestarts"):
        k8s.validate_pytorchjob(mistyped, CRD)
    bad_pod = copy.deepcopy(k8s.job_pod_template(job))
    bad_pod["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(Exception, match="volumeMount"):
        k8s.validate_pod_template(bad_pod)


def test_hyperpodpytorchjob_validated_against_hyperpods_model_when_generated(tmp_path, monkeypatch):
    before = {m for m in ("sagemaker", "boto3") if m in sys.modules}  # the S3 tests' server uses boto3
    _, job = generate(tmp_path, "--kind", "hyperpodpytorchjob", "--nodes", "2", "--instance-type",
                      "p4de.24xlarge", "--image", IMAGE, "--pvc", "fsx",
                      overrides=("train.global_batch_size=64",))
    assert (job["apiVersion"], job["kind"]) == ("sagemaker.amazonaws.com/v1", "HyperPodPyTorchJob")
    assert job["spec"]["nprocPerNode"] == "8" and job["spec"]["replicaSpecs"][0]["replicas"] == 2
    assert job["spec"]["runPolicy"]["jobMaxRetryCount"] == 10
    assert "namespace" not in job["metadata"]
    k8s.validate_pod_template(k8s.job_pod_template(job))
    schemas.validate_hyperpodpytorchjob(job)
    script = k8s.job_pod_template(job)["spec"]["containers"][0]["command"][2]
    # hyperpodrun SIGKILLs its workers on shutdown unless told SIGTERM and a timeout.
    assert ("exec python3 -m podtrain.launch.agent hyperpodrun --nnodes=2 --nproc-per-node=8 "
            "--shutdown-signal=SIGTERM --shutdown-timeout=120 ") in script
    # The model, shipped in the package with its licence header, loads without sagemaker-hyperpod.
    model = schemas.HYPERPOD_MODEL_FILE
    assert model.is_relative_to(Path(k8s.__file__).parent) and "License: Apache-2.0" in model.read_text()[:400]
    assert {m for m in ("sagemaker", "boto3") if m in sys.modules} <= before
    # What the model rejects: a missing required field, a field it does not know.
    lacking = copy.deepcopy(job)
    del lacking["spec"]["runPolicy"]["restartPolicy"]["evalPeriodSeconds"]
    with pytest.raises(ValueError, match="spec.runPolicy.restartPolicy.evalPeriodSeconds"):
        schemas.validate_hyperpodpytorchjob(lacking)
    unknown = copy.deepcopy(job)
    unknown["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        schemas.validate_hyperpodpytorchjob(unknown)
    unknown = copy.deepcopy(job)
    unknown["spec"]["nprocPerNod"] = "8"
    with pytest.raises(ValueError, match="spec.nprocPerNod"):
        schemas.validate_hyperpodpytorchjob(unknown)
    # Generation itself validates: a spec the model refuses is never written.
    monkeypatch.setattr(k8s, "HYPERPOD_EVAL_PERIOD_S", "half an hour")
    with pytest.raises(ValueError, match="evalPeriodSeconds"):
        main(["launch", "k8s", DEMO, "--kind", "hyperpodpytorchjob", "--nodes", "1", "--gpus-per-node",
              "8", "--image", IMAGE, "train.micro_batch_size=4", "train.global_batch_size=32",
              "--output", str(tmp_path / "bad.yaml")])
    assert not (tmp_path / "bad.yaml").exists()


def test_service_account_in_both_kinds_and_no_secret_in_the_manifests(tmp_path, crd_schema, monkeypatch):
    from s3_server import TEST_SECRET

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET)  # what a user's shell may hold
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    for kind in k8s.KINDS:
        config_map, job = generate(tmp_path, "--kind", kind, "--nodes", "2", "--gpus-per-node", "8",
                                   "--image", IMAGE, "--pvc", "fsx", "--service-account", "podtrain-s3",
                                   overrides=("ckpt.dir=s3://bucket/runs/ckpt",))
        if kind == "pytorchjob":
            check_pytorchjob(job, crd_schema)
        else:
            schemas.validate_hyperpodpytorchjob(job)
        assert k8s.job_pod_template(job)["spec"]["serviceAccountName"] == "podtrain-s3"
        assert yaml.safe_load(config_map["data"]["config.yaml"])["ckpt"]["dir"] == "s3://bucket/runs/ckpt"
        text = (tmp_path / "job.yaml").read_text()
        assert TEST_SECRET not in text and "AKIAEXAMPLE" not in text


BAD_INPUT = [
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--service-account", "Team_A"],
     "--service-account 'Team_A' is not a valid Kubernetes name"),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", "podtrain"], "has no tag"),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", "registry:5000/podtrain"], "has no tag"),
    (["--nodes", "0", "--gpus-per-node", "8", "--image", IMAGE], "--nodes must be at least 1"),
    (["--nodes", "2", "--instance-type", "g5.12xlarge", "--gpus-per-node", "8", "--image", IMAGE,
      "--pvc", "fsx"], "does not fit --instance-type g5.12xlarge"),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx", "optim.lr=fast"],
     "config key 'optim.lr' expects a number"),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE], "needs --pvc"),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx", "run.dir=/scratch/r"],
     "is not under --mount /fsx"),
    (["--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx",
      "--hyperpod-auto-resume", "--namespace", "team-a"], "HyperPod auto-resume needs the kubeflow namespace"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--kind", "hyperpod"],
     "--kind hyperpod is now --kind hyperpodpytorchjob"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--hyperpod"],
     "--hyperpod is now --hyperpod-auto-resume"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--kind", "pytorchjobs"],
     "--kind pytorchjobs is not one of pytorchjob, hyperpodpytorchjob"),
    (["--nodes", "3", "--min-nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx",
      "train.global_batch_size=96"], "not divisible"),
    # What no line of the pod's command can carry (see test_launch_quoting.py):
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "run.dir=/fsx/a\nb"],
     "run.dir '/fsx/a\\nb' contains a newline"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx", "--mount", "/fsx\x00"],
     "--mount '/fsx\\x00' contains NUL"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", "repo/podtrain:v1$(id)"], "is not an image tag"),
    # argparse's own mistakes: one line naming the option, not its 14-line usage
    (["--nodes", "1", "--gpus-per-node", "8"],
     "podtrain launch k8s: missing --image: container image with podtrain, tagged; "
     "`podtrain launch k8s --help` shows every option"),
    (["--gpus-per-node", "8", "--image", IMAGE], "missing --nodes: pods to run"),
    (["--nodes", "two", "--image", IMAGE], "argument --nodes: invalid int value: 'two'"),
    (["--nodes", "1", "--image", IMAGE, "--gpu", "8"], "ambiguous option: --gpu could match"),
    (["--nodes", "1", "--image", IMAGE, "--pvcs", "fsx"], "unrecognized arguments: --pvcs"),
    # What kubectl apply would refuse, refused here
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "FSX_claim"],
     "--pvc 'FSX_claim' is not a valid Kubernetes name"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--namespace", "team.a"],
     "--namespace 'team.a' is not a valid Kubernetes name"),
    (["--nodes", "1", "--gpus-per-node", "8", "--image", IMAGE, "--shm-size", "lots"],
     "--shm-size 'lots' is not a Kubernetes quantity"),
]


@pytest.mark.parametrize("flags,message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, capsys, flags, message):
    out = tmp_path / "job.yaml"
    code = main(["launch", "k8s", DEMO, "train.micro_batch_size=4", "train.global_batch_size=64",
                 *[f for f in flags if "=" in f], *[f for f in flags if "=" not in f],
                 "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("podtrain: error: "), err
    assert message in err, err
    assert not out.exists()


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "job.yaml").mkdir()
    code = main(["launch", "k8s", DEMO, "train.global_batch_size=64", "--nodes", "1", "--gpus-per-node", "8",
                 "--image", IMAGE, "--output", str(tmp_path / "job.yaml")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err[-1] == f"podtrain: error: --output {tmp_path / 'job.yaml'}: cannot write it (Is a directory)"
    assert not any("Traceback" in line for line in err)


def operator_environment(job: dict, rdzv_endpoint: str) -> dict[str, str]:
    """The variables Kubeflow's training operator (v1.9, elastic mode) adds to each worker pod,
    computed from the manifest; only the rendezvous host differs (no cluster DNS here)."""
    policy = job["spec"]["elasticPolicy"]
    return {
        "PYTHONUNBUFFERED": "0",
        "PET_RDZV_ENDPOINT": rdzv_endpoint,
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"]),
    }


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet makes of a container's command, args and env values, byte for byte as
    Kubernetes' ``third_party/forked/golang/expansion.Expand``: ``$(NAME)`` becomes NAME's value
    where ``env`` defines it (else stays), ``$$`` becomes ``$``, and any other ``$X`` stays, X
    read as one byte turned into a character (``string(input[0])`` in Go: a ``$`` before a
    non-ASCII character garbles it)."""
    data, out, i = text.encode("utf-8", "surrogateescape"), bytearray(), 0
    while i < len(data):
        if data[i] != ord("$") or i + 1 == len(data):
            out.append(data[i])
            i += 1
        elif data[i + 1] == ord("$"):
            out += b"$"
            i += 2
        elif data[i + 1] == ord("(") and data.find(b")", i + 2) >= 0:
            close = data.find(b")", i + 2)
            name = data[i + 2:close].decode("utf-8", "surrogateescape")
            out += env.get(name, f"$({name})").encode("utf-8", "surrogateescape")
            i = close + 1
        else:
            out += b"$" + chr(data[i + 1]).encode()
            i += 2
    return out.decode("utf-8", "surrogateescape")


def pod_process(container: dict, extra_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of the container's process as the kubelet starts it: its env
    values expanded in order (each may refer to the ones before it), ``extra_env`` (what the
    kubelet and the operator add: POD_IP, PET_*...) added, and the command expanded with all."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = kubelet_expand(item["value"], env)
    env.update(extra_env)
    return [kubelet_expand(arg, env) for arg in container["command"]], env


def start_pods(tmp_path: Path, job: dict, config_text: str, count: int) -> list[subprocess.Popen]:
    """Run the manifest's container command as ``count`` pods would: what the kubelet provides
    (the ConfigMap mounted as a file, the pod IP, the working directory, the container's env,
    ``$(...)`` expansion) and what the training operator adds (``PET_*``); ``python3`` is this
    interpreter."""
    container = k8s.job_pod_template(job)["spec"]["containers"][0]
    config_file = tmp_path / "configmap" / "config.yaml"
    config_file.parent.mkdir(exist_ok=True)
    config_file.write_text(config_text)
    Path(container["workingDir"]).mkdir(exist_ok=True)
    endpoint = f"127.0.0.1:{free_port()}"
    command, pod_env = pod_process(container, {"PODTRAIN_CONFIG": str(config_file), "POD_IP": "127.0.0.1",
                                               **operator_environment(job, endpoint)})
    base = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    return [subprocess.Popen(command, cwd=container["workingDir"], env={**base, **pod_env},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(count)]


@pytest.mark.e2e
def test_worker_command_from_manifest_trains_in_two_pods_then_exits_143_after_sigterm_and_2_on_a_config_mistake(
        tmp_path):
    """Two pods (one rank each) run the manifest's container command and train together; then
    Kubernetes deletes them (SIGTERM to each container's PID 1): the agent in the command turns the
    workers' reports into the container's exit status, 143 with a checkpoint, where torchrun alone
    would exit 1 (ExitCode restarts 143, not 2). One pair of pods serves both cases (the stop was a
    training of its own: ~20 s of CPU)."""
    data = prepare_data(tmp_path / "data")
    mount = tmp_path / "fsx"  # stands for the shared claim, mounted at the same path in each pod
    config_map, job = generate(tmp_path, "--nodes", "2", "--gpus-per-node", "0",
                               "--nproc-per-node", "1", "--image", IMAGE, "--pvc", "shared",
                               "--mount", str(mount), "--join-timeout", "60",
                               overrides=(f"data.path={data}", *TINY_TRAINING, "train.steps=2000",
                                          "run.dir=runs/k8s", "train.global_batch_size=8", "ckpt.every=1000"))
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] == "ExitCode"
    run_dir = mount / "runs" / "k8s"
    pods = start_pods(tmp_path, job, config_map["data"]["config.yaml"], 2)
    outputs = []
    try:
        deadline = time.monotonic() + 150
        while len(read_metrics(run_dir)) < 3 and all(p.poll() is None for p in pods) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.poll() is None for p in pods), "\n".join(p.communicate()[1][-2000:] for p in pods)
        for pod in pods:
            pod.send_signal(signal.SIGTERM)  # what the kubelet sends each container's PID 1
        for pod in pods:
            outputs.append(pod.communicate(timeout=120))
    finally:
        for pod in pods:
            if pod.poll() is None:
                pod.kill()
                pod.wait()
    errs = [err for _, err in outputs]
    assert [p.returncode for p in pods] == [143, 143], "\n".join(e[-2000:] for e in errs)
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3, steps
    assert all(r["world_size"] == 2 and math.isfinite(r["loss"]) for r in records)
    step = layout.parse_step((run_dir / "ckpt" / "latest").read_text().strip())
    assert 3 <= step < 2000 and step == steps[-1]
    verdict = verify(run_dir / "ckpt" / layout.step_name(step))
    assert verdict.ok, verdict.reason
    for out, err in outputs:  # each pod's container says how its part of the job ended
        own = [line for line in err.splitlines() if line.startswith("podtrain:")]
        assert own == [f"podtrain: stopped by SIGTERM at step {step}, checkpoint {layout.step_name(step)} "
                       "saved; run the same command to resume"], err[-3000:]
        assert "Traceback" not in out + err, err[-3000:]
    assert list((run_dir / "logs").glob("torchrun_*.log")), "torchrun's own lines were not kept"

    # A mistake in the ConfigMap: one line naming it, exit 2, before torchrun starts.
    broken = config_map["data"]["config.yaml"].replace("lr: 0.003", "lr: fast")
    assert broken != config_map["data"]["config.yaml"]
    (pod,) = start_pods(tmp_path, job, broken, 1)
    out, err = pod.communicate(timeout=60)
    assert pod.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("podtrain: error: ") and "optim.lr" in err, err


@pytest.mark.slow
def test_generation_validates_against_the_shipped_crd_and_prints_the_path_mapping(tmp_path, monkeypatch,
                                                                                   capsys):
    # The CRD inside the package, with its source header, is what `launch k8s` validates against.
    assert CRD.is_relative_to(Path(k8s.__file__).parent) and "Apache License 2.0" in CRD.read_text()[:600]
    generate(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE, "--pvc", "fsx",
             overrides=("run.dir=runs/x",))
    err = capsys.readouterr().err
    assert "podtrain: run.dir in the pods: runs/x -> /fsx/runs/x (on claim fsx mounted at /fsx)" in err
    assert "podtrain: data.path in the pods: data/builtin -> /fsx/data/builtin" in err
    # A CRD that demands a field podtrain does not write: generation itself now fails.
    strict = yaml.safe_load(CRD.read_text())
    strict["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["required"] = \
        ["notAField"]
    tampered = tmp_path / "crd.yaml"
    tampered.write_text(yaml.safe_dump(strict))
    monkeypatch.setattr(k8s, "CRD_FILE", tampered)
    with pytest.raises(ValueError, match="notAField"):
        main(["launch", "k8s", DEMO, "--nodes", "2", "--gpus-per-node", "8", "--image", IMAGE,
              "--pvc", "fsx", "train.micro_batch_size=4", "train.global_batch_size=64",
              "--output", str(tmp_path / "j.yaml")])
    assert not (tmp_path / "j.yaml").exists()


def test_shutdown_timeout_only_where_the_launcher_has_it():
    # torchrun took --shutdown-timeout in torch 2.12 and rejects it before: local and Slurm
    # decide by the installed torch, the container's agent by the image's at run time.
    assert [torchrun.torchrun_has_shutdown_timeout(v) for v in ("2.8.0", "2.11.0", "2.12.0+cu128",
                                                                "2.13.0+cpu", "3.0")] == \
        [False, False, True, True, True]
    assert "--shutdown-timeout=90" in torchrun.torchrun_flags(nproc=2, grace_s=90, shutdown_flag=True)
    assert not any(f.startswith("--shutdown") for f in
                   torchrun.torchrun_flags(nproc=2, grace_s=90, shutdown_flag=False))
    command = ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "podtrain.cli",
               "train", "/etc/podtrain/config.yaml", "train.steps=5"]
    assert agent.train_arguments(command) == ("/etc/podtrain/config.yaml", ["train.steps=5"])
    assert agent.with_shutdown_timeout(command, 90, supported=True) == [
        "python3", "-m", "torch.distributed.run", "--shutdown-timeout=90", *command[3:]]
    assert agent.with_shutdown_timeout(command, 90, supported=False) == command
    given = [*command[:3], "--shutdown_timeout=40", *command[3:]]
    assert agent.with_shutdown_timeout(given, 90, supported=True) == given
    hyperpodrun = ["hyperpodrun", "--shutdown-signal=SIGTERM", "--shutdown-timeout=120", *command[3:]]
    assert agent.with_shutdown_timeout(hyperpodrun, 90, supported=True) == hyperpodrun
    with pytest.raises(UserError, match="must run `-m podtrain.cli train CONFIG`"):
        agent.train_arguments(["torchrun", "train.py"])


UNREACHABLE = re.compile(r"NewConnectionError|Failed to establish a new connection|Name or service not "
                         r"known|Temporary failure in name resolution|Network is unreachable|"
                         r"ConnectTimeoutError|Read timed out")


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


@pytest.mark.slow
def test_a_hyperpod_image_installs_podtrain_with_hyperpod_elastic_agent(hyperpod_resolution):
    """hyperpod-elastic-agent 1.1.3 (hyperpodrun) needs torch < 2.12: podtrain's floors must let
    pip resolve both into one image. One resolver call, against the real index (started when the
    session starts: tests/conftest.py)."""
    code, output, report = hyperpod_resolution
    unreachable = UNREACHABLE.search(output)
    if code != 0 and unreachable:
        pytest.skip(f"the package index cannot be reached ({unreachable[0]}): nothing to resolve against")
    assert code == 0, output[-3000:]
    installed = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                 for item in json.loads(report.read_text())["install"]}
    assert installed["podtrain"] == podtrain.__version__
    assert _release(installed["hyperpod-elastic-agent"]) >= (1, 1, 3)
    assert (2, 8) <= _release(installed["torch"])[:2] < (2, 12), installed["torch"]
