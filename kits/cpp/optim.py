"""Host side of the C++ multi-tensor AdamW (kernels/adamw.cu): the per-list device tables and the
launch. One launch per call; nothing is read back to the host."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Optional, Sequence, Union

import torch

from hal.arrays import address_columns, float32_value, table_rows

from .kit import C_TYPES, DTYPE_NAMES, Kit, cdiv

THREADS = 256  # ADAMW_THREADS of adamw.cu
#: elements per block: 4 steps of 8 values per thread
CHUNK = THREADS * 8 * 4
TABLE_FIELDS = 8

Scalar = Union[float, torch.Tensor]


class Tables:
    """Per-list device tables, cached by the tensors' addresses and sizes (steady-state steps and
    CUDA graph replays upload nothing): an LRU of a few lists."""

    def __init__(self, size: int = 32) -> None:
        self._lru: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, columns: tuple[tuple[int, ...], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
        """(table, chunk map, chunks, every address 16-byte aligned) of the tensors of ``columns``
        (hal.arrays.address_columns of five lists: five address columns, element counts last)."""
        key = (str(device), columns)
        with self._lock:
            hit = self._lru.get(key)
            if hit is not None:
                self._lru.move_to_end(key)
                return hit[:4]
        rows = table_rows(columns)
        counts = torch.tensor([cdiv(n, CHUNK) for n in columns[5]], dtype=torch.int64)
        first = torch.cumsum(counts, 0) - counts
        table = torch.zeros((len(counts), TABLE_FIELDS), dtype=torch.int64)
        table[:, :6] = rows
        table[:, 6] = first
        chunk_map = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)
        aligned = all(a % 16 == 0 for col in columns[:5] for a in col)
        host = (table, chunk_map)
        if device.type != "cpu":  # pinned, so the uploads are asynchronous and graph-capturable
            host = tuple(t.pin_memory() for t in host)
        dev = tuple(t.to(device, non_blocking=True) for t in host)
        entry = (dev[0], dev[1], int(counts.sum()), aligned, host)
        with self._lock:
            self._lru[key] = entry  # the host copies stay alive with the device tables
            while len(self._lru) > self._size:
                self._lru.popitem(last=False)
        return entry[:4]


TABLES = Tables()


def _float32_tensor(v: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1).float()


def fused_adamw(
    kit: Kit,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    master_params: Optional[Sequence[torch.Tensor]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: Scalar,
    inv_scale: Optional[Scalar],
    found_inf: Optional[Scalar],
) -> None:
    """One AdamW step over contiguous tensors of one param dtype, one grad dtype (the params', or
    float32 beside master weights) and one moment dtype, in place (see hal.ops.fused_adamw_). step,
    inv_scale and found_inf are read as float32 (device values stay there: a step count on the
    device is turned into the bias corrections by the kernel)."""
    if not params:
        return
    if found_inf is not None and not isinstance(found_inf, torch.Tensor) and float(found_inf) != 0.0:
        return
    device = params[0].device
    table, chunk_map, chunks, aligned = TABLES.get(address_columns((params, grads, exp_avgs, exp_avg_sqs, master_params)), device)
    if chunks == 0:
        return
    found = _float32_tensor(found_inf) if isinstance(found_inf, torch.Tensor) else None
    inv_t = _float32_tensor(inv_scale) if isinstance(inv_scale, torch.Tensor) else None
    inv_v = 1.0 if inv_scale is None or inv_t is not None else float32_value(float(inv_scale))
    kernel = kit.module("adamw", device, HAL_P=C_TYPES[DTYPE_NAMES[params[0].dtype]], HAL_G=C_TYPES[DTYPE_NAMES[grads[0].dtype]],
                        HAL_S=C_TYPES[DTYPE_NAMES[exp_avgs[0].dtype]])["adamw_step"]
    flags = int(master_params is not None) | (int(aligned) << 1)
    if isinstance(step, torch.Tensor):
        step_t, step_size, bc2_sqrt = _float32_tensor(step), 0.0, 0.0
    else:
        step_t, step_size, bc2_sqrt = None, lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)
    kernel((chunks,), THREADS, table, chunk_map, CHUNK, found, inv_t, step_t, inv_v, lr, 1.0 - lr * weight_decay,
           step_size, bc2_sqrt, beta1, beta2, eps, flags, device=device)
