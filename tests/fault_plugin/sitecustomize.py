"""Test-only fault injection into podtrain processes that a test starts (torchrun workers, srun tasks).

Python imports ``sitecustomize`` at start-up from ``sys.path``. A test that wants a fault puts this
folder on ``PYTHONPATH`` and names the faults in ``PODTRAIN_TEST_FAULTS`` (``fault_env`` in
``podtrain_faults`` builds that environment); production code reads no such variable and carries
no hook: the faults patch podtrain's functions from outside.
"""

import os

if os.environ.get("PODTRAIN_TEST_FAULTS"):
    import podtrain_faults

    podtrain_faults.install(os.environ["PODTRAIN_TEST_FAULTS"])
