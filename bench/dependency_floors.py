#!/usr/bin/env python3
"""Check pyproject.toml's dependency floors: a short real job with exactly those versions installed.

Creates a fresh virtual environment in a temporary directory, installs torch (TORCH_SPEC, default
the Makefile's torch==2.13.0: the torch floor's (2.8) Linux wheels on PyPI are multi-GB CUDA builds,
so on a CPU machine the pinned CPU build from pip's find-links stands in; on a machine with the
torch floor's wheel at hand, run with TORCH_SPEC=torch==2.8.0), then EXACTLY the floor of
every other dependency and of the parquet and k8s extras, read from pyproject.toml (so this
script cannot drift from what is declared), then podtrain itself with --no-deps. In that
environment, from a scratch working directory, it runs: ``pip check``; ``podtrain prepare builtin``
(small) and ``prepare`` of a Parquet file (pyarrow floor); a 2-rank ``podtrain launch local`` of
configs/demo.yaml for 3 steps with the rich progress bar (rich floor); ``podtrain export``, then
``from_pretrained`` logits equal to the checkpoint's model; ``podtrain sample``; ``podtrain launch
k8s`` (pod template validated by the kubernetes-validate floor) and ``launch k8s --kind
hyperpodpytorchjob`` (validated by HyperPod's model on the pydantic floor). Prints the versions tested and
PASS/FAIL per stage; exits 1 when any stage fails.

Usage (from the repo root, Python >= 3.11 for tomllib; ~1.5 minutes on 2 cores with a warm pip
cache, ~4 cold; needs the package index):
    python3 bench/dependency_floors.py [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
EXTRAS = ("parquet", "k8s")
FLOOR = re.compile(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*$")

LOGITS_CHECK = """
import sys, torch
from transformers import AutoModelForCausalLM
from podtrain.ckpt.reader import build_model_from_checkpoint, load_latest, run_config_of
run, out = sys.argv[1], sys.argv[2]
ckpt = load_latest(run)
ours = build_model_from_checkpoint(ckpt, run_config_of(run, ckpt))
hf = AutoModelForCausalLM.from_pretrained(out).eval()
x = torch.randint(0, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    want, got = ours(input_ids=x).logits, hf(input_ids=x).logits
assert torch.equal(want, got), f"max |diff| {(want - got).abs().max().item()}"
print(f"logits equal: {tuple(got.shape)}, step {ckpt.step}")
"""

K8S_CHECK = """
import sys, yaml
from podtrain.launch import k8s
template = k8s.job_pod_template(list(yaml.safe_load_all(open(sys.argv[1])))[1])
k8s.validate_pod_template(template)
template["spec"]["containers"][0]["bogusField"] = 1
try:
    k8s.validate_pod_template(template)
except Exception as exc:
    print(f"pod template valid; an unknown field is rejected ({type(exc).__name__})")
else:
    raise SystemExit("kubernetes-validate accepted an unknown field")
"""

PARQUET = """
import sys, pyarrow as pa, pyarrow.parquet as pq
rows = [f"def f{i}(x):\\n    return x * {i}\\n" * 20 for i in range(400)]
pq.write_table(pa.table({"text": rows}), sys.argv[1], row_group_size=100)
"""


def floors() -> dict[str, str]:
    """``{distribution: floor}`` of the dependencies and the EXTRAS, from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in EXTRAS:
        specs += project["optional-dependencies"][extra]
    found = {}
    for spec in specs:
        match = FLOOR.match(spec)
        if match is None:
            raise SystemExit(f"pyproject.toml: {spec!r} is not NAME>=FLOOR")
        found[match[1]] = match[2]
    return found


def release(pin: str) -> str:
    """``name==version`` with trailing ``.0`` components dropped (``rich==12.0`` is ``12.0.0``)."""
    return re.sub(r"(\.0)+$", "", pin)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    wanted = floors()
    pins = [f"{name}=={version}" for name, version in wanted.items() if name != "torch"]
    root = Path(tempfile.mkdtemp(prefix="podtrain-floors-"))
    venv, work = root / "venv", root / "work"
    work.mkdir()
    py, podtrain = venv / "bin" / "python", venv / "bin" / "podtrain"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    results: list[tuple[str, bool, float]] = []

    def stage(name: str, *commands: list[str]) -> bool:
        start = time.perf_counter()
        ok = True
        for cmd in commands:
            proc = subprocess.run(cmd, cwd=work, env=env, text=True, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT)
            if proc.returncode != 0:
                print(proc.stdout[-4000:])
                ok = False
                break
            lines = [line for line in proc.stdout.splitlines()
                     if line.strip() and "WARNING: Location" not in line]  # pip on local mirrors
            tail = lines[-2:]
            print("\n".join(f"    {line[:160]}" for line in tail))
        results.append((name, ok, time.perf_counter() - start))
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({results[-1][2]:.0f} s)", flush=True)
        return ok

    started = time.perf_counter()
    pip = [str(py), "-m", "pip", "install", "-q"]
    installed = stage("install: venv, " + TORCH_SPEC + ", exact floors, podtrain --no-deps",
                      [sys.executable, "-m", "venv", str(venv)],
                      pip + [TORCH_SPEC],
                      pip + [TORCH_SPEC] + pins,  # torch named again so the resolver keeps it
                      pip + ["--no-deps", str(REPO)])
    if installed:
        versions = subprocess.run(
            [str(py), "-c", "import sys, importlib.metadata as m; "
             "print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))", "torch", *(n for n in wanted if n != "torch")],
            env=env, text=True, capture_output=True).stdout.split()
        print("tested: " + " ".join(versions) + f"  (Python {sys.version.split()[0]})")
        mismatched = [v for v in versions[1:] if release(v) not in map(release, pins)]
        results.append(("installed versions are exactly the floors", not mismatched, 0.0))
        print(f"{'FAIL' if mismatched else 'PASS'}  installed versions are exactly the floors"
              + (f": {mismatched}" if mismatched else ""))
        stage("pip check", [str(py), "-m", "pip", "check"])
        stage("prepare builtin (byte tokens, 3 MB)",
              [str(podtrain), "prepare", "builtin", "--out", "data/builtin", "--builtin-bytes",
               "3000000", "--no-progress"])
        stage("prepare parquet (pyarrow.parquet.ParquetFile.iter_batches)",
              [str(py), "-c", PARQUET, "corpus.parquet"],
              [str(podtrain), "prepare", "corpus.parquet", "--out", "data/parquet", "--no-progress"])
        demo = str(REPO / "configs" / "demo.yaml")
        trained = stage("launch local: 2 ranks over gloo, 3 steps, checkpoint, rich progress bar",
                        [str(podtrain), "launch", "local", demo, "--nproc", "2", "run.dir=runs/floors",
                         "data.path=data/builtin", "train.steps=3", "data.seq_len=64",
                         "train.micro_batch_size=2", "train.global_batch_size=4", "log.every=1",
                         "log.progress=rich", "eval.every=3", "eval.max_batches=2", "ckpt.every=3"])
        if trained:
            if stage("export", [str(podtrain), "export", "runs/floors", "hf"]):
                stage("from_pretrained logits equal the checkpoint's",
                      [str(py), "-c", LOGITS_CHECK, "runs/floors", "hf"])
            stage("sample", [str(podtrain), "sample", "runs/floors", "--max-new-tokens", "20"])
        stage("launch k8s (pod template validated by kubernetes-validate, strict)",
              [str(podtrain), "launch", "k8s", demo, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
               "--image", "podtrain:floors", "--output", "job.yaml"],
              [str(py), "-c", K8S_CHECK, "job.yaml"])
        stage("launch k8s --kind hyperpodpytorchjob (HyperPod's pydantic model, by_name)",
              [str(podtrain), "launch", "k8s", demo, "--kind", "hyperpodpytorchjob", "--nodes", "1",
               "--gpus-per-node", "0", "--nproc-per-node", "2", "--image", "podtrain:floors",
               "--output", "hyperpod.yaml"])
    wall = time.perf_counter() - started
    failed = [name for name, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} stages passed in {wall:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
