"""Settings every test of the repository runs under (tests/, backends/*/tests).

Kernel choice by measurement (HAL_TUNE) is off unless a test turns it on: a test that checks which
kernel a call takes would otherwise depend on the timings of the machine it runs on. Measurements a
test makes go to a temporary directory, never to the user's cache.
"""

import os
import tempfile

os.environ.setdefault("HAL_TUNE", "off")
os.environ.setdefault("HAL_TUNE_CACHE", tempfile.mkdtemp(prefix="hal-tune-tests-"))
