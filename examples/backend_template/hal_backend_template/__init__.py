"""A template for a hal backend that lives outside hal's source tree.

It is a complete, installable backend (``pip install examples/backend_template``) with three ops,
each written in plain PyTorch against hal's public plugin surface only:

- ``swiglu`` (:mod:`.elementwise`): an elementwise op, with broadcasting;
- ``softmax`` (:mod:`.reduction`): a reduction along one dimension;
- ``rms_norm`` and its backward op ``rms_norm_backward`` (:mod:`.norm`): an op whose gradient
  hal computes by dispatching the backward op to this backend.

The package's import does what hal asks of every plugin and nothing else: it builds the
:class:`~hal.plugin.Plugin` named by the entry point (pyproject.toml), defines the backend and,
through the imports at the bottom, registers the kernels. No device work happens here.

A real backend would replace the kernels' bodies with calls into its own library (its kernels
receive torch tensors, ``array_api="torch"``; NumPy inputs reach them as zero-copy views) and
``device_types``/``probe``/``devices`` with its device's. ``hal conformance --backend template``
checks every kernel against hal's reference, cpu_ref, in float64.
"""

from __future__ import annotations

import platform
from typing import Optional

from hal.plugin import DeviceInfo, Plugin

__version__ = "0.1.0"

#: The backend's rank among the backends serving the CPU: below cpu_ref (0) and the eager backend
#: (-10), so installing the template changes no call until it is asked for
#: (``hal.use(backend="template")``, ``HAL_BACKEND=template``, ``hal conformance --backend
#: template``). A backend for a device no other backend serves takes any priority; one meant to win
#: on a shared device ranks above the others there (the ``cpu`` backend has 50).
PRIORITY = -20

plugin = Plugin("template", __version__, summary="template out-of-tree backend: three ops in plain PyTorch")


def _devices() -> list[DeviceInfo]:
    """The one device the backend runs on: this machine's CPU (conformance reports name it)."""
    machine = platform.machine() or "unknown"
    return [DeviceInfo(index=0, name=platform.processor() or machine, vendor="template", arch=machine)]


def _probe() -> Optional[str]:
    """None: the backend is usable. A real backend checks here, lazily, that its library loads and
    a device is present, and otherwise returns the sentence ``hal info`` shows (e.g. "no MyChip
    device")."""
    return None


plugin.define_backend(priority=PRIORITY, device_types=("cpu",), probe=_probe, devices=_devices, array_api="torch")

# Importing the op families registers their kernels on `plugin`.
from . import elementwise, norm, reduction  # noqa: E402,F401
