"""The schemas ``launch k8s`` checks every manifest against before writing it, shipped in this
folder (each file's header names its source and licence):

* ``kubeflow.org_pytorchjobs.yaml``: the training operator's PyTorchJob CRD (jsonschema, plus a
  walk that rejects fields the schema does not name, which the schema alone lets through);
* ``hyperpod_pytorch_job_unified_config.py.txt``: SageMaker HyperPod's pydantic model of a
  HyperPodPyTorchJob ``spec`` (from the sagemaker-hyperpod package, whose own ``__init__`` pulls
  in boto3 and kubernetes: the file is loaded by path and imports only pydantic);
* the core Kubernetes pod template, offline, through ``kubernetes-validate`` when installed
  (``pip install podtrain[k8s]``).

A manifest podtrain generates that fails one of them is a podtrain bug: ValueError, traceback.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

SCHEMA_DIR = Path(__file__).resolve().parent


CRD_FILE = SCHEMA_DIR / "kubeflow.org_pytorchjobs.yaml"
"""The PyTorchJob CRD shipped with podtrain (see the file's header for its source and license)."""


@functools.lru_cache(maxsize=4)
def crd_schema(crd_path: str | Path = CRD_FILE) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of a CRD file (by default the shipped PyTorchJob CRD)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 600 kB: the C loader is 10x faster
    crd = yaml.load(Path(crd_path).read_text(), Loader=loader)
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def unknown_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Paths in ``obj`` that ``schema`` does not name (what the API server would prune).

    Walks ``properties``, map values (``additionalProperties``) and list ``items``; stops where
    the schema keeps unknown fields or gives no structure (``metadata: {type: object}``).
    """
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(schema, dict):
        return []
    found: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                found += unknown_fields(value, props[key], where)
            elif isinstance(extra, dict):
                found += unknown_fields(value, extra, where)
            elif props is not None:
                found.append(where)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            found += unknown_fields(value, schema["items"], f"{path}[{i}]")
    return found


def validate_pytorchjob(job: dict[str, Any], crd_path: str | Path = CRD_FILE) -> None:
    """Raise ValueError when ``job`` breaks the PyTorchJob CRD schema or has unknown fields."""
    import jsonschema

    schema = crd_schema(crd_path)
    errors = sorted(jsonschema.Draft4Validator(schema).iter_errors(job), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        raise ValueError(f"PyTorchJob schema: {'.'.join(map(str, first.path))}: {first.message}")
    extra = unknown_fields(job, schema)
    if extra:
        raise ValueError(f"PyTorchJob has fields its schema does not know: {', '.join(extra)}")


def validate_pod_template(template: dict[str, Any], version: str | None = None) -> None:
    """Validate a pod template against core Kubernetes (offline, strict: unknown fields fail)."""
    import kubernetes_validate

    version = version or kubernetes_validate.latest_version()
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                  "metadata": {"name": "podtrain-check"}, "template": template},
                                 version, strict=True)


def job_pod_template(job: dict[str, Any]) -> dict[str, Any]:
    """The worker pod template of a PyTorchJob or HyperPodPyTorchJob manifest."""
    if job["kind"] == "PyTorchJob":
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return job["spec"]["replicaSpecs"][0]["template"]


HYPERPOD_MODEL_FILE = SCHEMA_DIR / "hyperpod_pytorch_job_unified_config.py.txt"
"""SageMaker HyperPod's pydantic model of a HyperPodPyTorchJob (see the file's header)."""


@functools.lru_cache(maxsize=2)
def hyperpod_model(path: str | Path = HYPERPOD_MODEL_FILE) -> ModuleType:
    """The HyperPod model file loaded as a module of its own (by path, whatever its suffix)."""
    loader = importlib.machinery.SourceFileLoader("podtrain_hyperpod_pytorch_job_model", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def validate_hyperpodpytorchjob(job: dict[str, Any], model_path: str | Path = HYPERPOD_MODEL_FILE) -> None:
    """Raise ValueError when ``job``'s ``spec`` breaks HyperPod's model or ``job`` has top-level
    fields a HyperPodPyTorchJob does not have.

    The model's nested classes forbid unknown fields; its top level ignores them, so they are
    rejected here. Fields are matched by their Kubernetes (camelCase) names (``by_name``).
    """
    import pydantic

    extra = sorted(set(job) - {"apiVersion", "kind", "metadata", "spec"})
    extra += [f"spec.{key}" for key in sorted(set(job.get("spec", {})) -
                                              set(hyperpod_model(model_path)._HyperPodPytorchJob.model_fields))]
    if extra:
        raise ValueError(f"HyperPodPyTorchJob has fields its schema does not know: {', '.join(extra)}")
    try:
        hyperpod_model(model_path)._HyperPodPytorchJob.model_validate(job["spec"], by_name=True)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        # pydantic names fields by their snake_case aliases: give the manifest's camelCase names.
        where = ".".join(str(part) if isinstance(part, int) else _camel(part) for part in first["loc"])
        raise ValueError(f"HyperPodPyTorchJob schema: spec.{where}: {first['msg']}") from None


def _camel(name: str) -> str:
    """``eval_period_seconds`` -> ``evalPeriodSeconds`` (the model's aliases are snake_case)."""
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)
