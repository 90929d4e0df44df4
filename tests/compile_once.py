"""Compile the bytecode the suite needs once, in one process, before pytest-xdist's workers start.

``make test`` writes bytecode into the venv (``PYTHONPYCACHEPREFIX``). On a fresh clone the cache is
empty, and the five workers collecting the suite at once each compiled the same ~3,900 modules
(torch, transformers, moto, the tests): 27 s of CPU per worker cold against 8 s warm, and the first
ranks of the first end-to-end tests compiled torch's and transformers' training modules again,
side by side. Here one process imports what a rank of ``launch local`` imports (the torchrun
agent, the training loop, transformers' Llama modeling) and then collects the suite; everything
after it reads the cache. Run by the Makefile once per install (a stamp); harmless to run again.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Import a rank's modules and collect the suite (nothing runs); pytest's collection exit code."""
    import pytest
    import torch.distributed.run  # noqa: F401 (the torchrun agent every launch starts)

    from podtrain.model import build_model, preset_config
    from podtrain.train import loop  # noqa: F401 (a rank's training path)

    build_model(preset_config("tiny", 320))  # what transformers' from_config imports for a Llama
    return int(pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", "tests"]))


if __name__ == "__main__":
    sys.exit(main())
