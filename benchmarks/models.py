"""Whole models with and without hal, results committed under benchmarks/results/.

    python benchmarks/models.py                        # every model, sizes for the device found
    python benchmarks/models.py --models llama_train --model-size cpu --no-compile

Runs ``hal bench --models`` (bench/models.py: what is measured and how) with any of its options,
writing ``models.json`` and ``models.md`` into ``benchmarks/results/models-<device>-<date>/`` unless
``--out DIR`` is given. On the H200, ``benchmarks/models_h200.sh`` runs it within one device call.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import torch

from hal.cli import main as hal_main

RESULTS = Path(__file__).resolve().parent / "results"


def _device_slug() -> str:
    """``h200`` for an NVIDIA H200 (the last word of the device name), ``cpu`` without a GPU."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).split()[-1].lower()
    return "cpu"


def main(argv: list[str]) -> int:
    if "--out" not in argv:
        date = datetime.date.today().isoformat()
        argv = [*argv, "--out", str(RESULTS / f"models-{_device_slug()}-{date}")]
    return hal_main(["bench", "--models", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
