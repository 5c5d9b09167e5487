"""Settings every test of the repository runs under (tests/, backends/*/tests).

Kernel choice by measurement (HAL_TUNE) is off unless a test turns it on: a test that checks which
kernel a call takes would otherwise depend on the timings of the machine it runs on. Measurements a
test makes go to a temporary directory, never to the user's cache; under pytest-xdist, one for each
worker.
"""

import os
import tempfile

os.environ.setdefault("HAL_TUNE", "off")
_cache = os.environ.setdefault("HAL_TUNE_CACHE", tempfile.mkdtemp(prefix="hal-tune-tests-"))
if "PYTEST_XDIST_WORKER" in os.environ:  # pytest-xdist (scripts/test.sh): the workers inherit the run's
    # cache folder from the controller; each measures into a folder of its own there ("gw0", "gw1")
    os.environ["HAL_TUNE_CACHE"] = os.path.join(_cache, os.environ["PYTEST_XDIST_WORKER"])
