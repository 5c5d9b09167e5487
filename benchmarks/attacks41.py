"""Issue 41's attack classes played again, as a new user would: each outcome classified against a
reference (torch's own behaviour, or the unpatched / unfused model, or the documented rule).

    .venv/bin/python benchmarks/attacks41.py [--quick] [--json OUT] [--classes a,b] [--seed N] [-v]

Classes (issue 41's items): ``numerics`` (every op at the edges: NaN/Inf, empty, non-contiguous and
overlapping views, wrong dtype or shape, NumPy, meta, autograd), ``optim`` (AdamW state hal <->
torch), ``nn`` (fuse and patch: hooks, parametrizations, parameter order, many layer chains;
Hugging Face models through transformers' own API), ``optimize``, ``library`` (user-declared ops
and user-registered kernels), ``fp8``, ``cli`` (``python -m hal ...``), ``tuning`` (tune-cache
records with fields of the wrong type, unreadable, corrupt or foreign files, other versions, unusable
directories, concurrent writers, HAL_TUNE values, seeds, TuneCache and hal.tune misused: judged by
hal.tuning.cache's documented rule, a result as torch's and one warning naming the file), ``parallel``
(hal.parallel on 2 real gloo ranks: ids and targets out of range against nn.Embedding and
F.cross_entropy, groups without the calling rank, shapes, dtypes and values that differ across ranks,
valid input against one process's torch; each rank judges its outcome, the worse counts; one launch
runs a batch of cases, a rank that dies or hangs loses only the case it was in, marked ``crash``).

Each attack ends in one of:

- ``correct``: the result agrees with the reference (NaN/Inf where it has them, shape, dtype);
- ``clear``: refused with a hal error (``hal.HalError``), with the exception torch itself raises
  for the same input, or with a hal-written message saying what to do (a user's own exception
  passed through as it is counts here too); the command line: exit status 2 and one line, no
  traceback;
- ``silent``: a result that differs from the reference, or bad input taken without a word;
- ``raw``: an unexpected exception leaking from the internals (AttributeError, KeyError, a bare
  TypeError ...), or a traceback from the command line;
- ``crash``: the process died (signal, abort) or hung past the attack's time limit.

Attacks run in worker processes (a few groups, two at a time), one attack after another; a worker
that dies or stops reporting loses only the attack it was running (marked ``crash``) and is started
again after it. Every input is drawn from seeded generators (``--seed``), never zeros.

Results (2026-12-07, this project's 2-core AMD EPYC VM, CPU only, seed 41, 67 s):

- while the classes were written (each class run on the code before its fixes, from 8f952d7): 15
  silent wrong results and 5 raw exceptions in hal, 0 crashes: optim 4 silent (a parameter without a
  gradient stepped another's count; torch states saved with amsgrad or maximize taken; a parameter
  listed twice), nn 6 silent (patch moved spectral_norm's vectors; its LM-head check fired the
  user's hooks, once per family), optimize 2 raw (a meta model; fewer arguments than ``inputs``),
  fp8 1 silent (DelayedScaling's negative margin), library 2 raw (``backward`` naming a forward op,
  ``tolerances`` not a mapping) and item 7's ``backward="no_such_backward"`` caught only at the first
  call. One crash was torch's own (``torch._fused_adamw_`` on mismatched shapes corrupts the heap: the
  reference is not called on such input).
- after the fixes, at 30f6d37: 931 attacks, 726 correct, 205 clear, 0 silent, 0 raw, 0 crash
  (numerics 364, optim 41, nn 347, optimize 65, fp8 36, library 52, cli 26).

- tuning and parallel, added at 7526437 (same VM and seed, both classes 16 s; ``--quick`` takes 7 and
  10 of them, one gloo launch, about 3 s more): before their fixes tuning 93 attacks, 73 correct, 16
  clear, 4 raw (a cache file nested too deeply raised RecursionError out of every measuring call;
  ``TuneCache(5, ...)``, versions not a mapping, ``hal.tune(5)``: bare TypeError / ValueError);
  parallel 90, 14 correct, 75 clear, 1 silent (``VocabParallelLMHead`` took a (1, 6) target for 6
  rows), and x's dtype differing across ranks in the vocab-parallel loss raised on one rank alone
  before the agreement check, leaving the group out of step: the 13 valid calls after it were refused.
  After the fixes: tuning 74 correct, 19 clear; parallel 27 correct, 63 clear; 0 silent, 0 raw, 0
  crash.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import json
import math
import os
import queue
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STATUSES = ("correct", "clear", "silent", "raw", "crash")
BAD = ("silent", "raw", "crash")
#: attack classes and the worker group each runs in (a group is one process, restarted after a crash)
CLASSES = {"numerics": "core", "optim": "core", "nn": "nn", "optimize": "optimize", "fp8": "core",
           "library": "library", "cli": "cli", "tuning": "tuning", "parallel": "parallel"}


# ----------------------------------------------------------------------------------------------------
# outcomes
# ----------------------------------------------------------------------------------------------------


class Verdict(Exception):
    """Raised by an attack to state its outcome directly."""

    def __init__(self, status: str, detail: str = "") -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclasses.dataclass
class Attack:
    cls: str
    name: str
    fn: Callable[[], Any]
    quick: bool = False
    timeout_s: float = 90.0

    @property
    def id(self) -> str:
        return f"{self.cls}/{self.name}"


_HAL_FILES = (str(ROOT / "hal"), str(ROOT / "backends"), str(ROOT / "ops"), str(ROOT / "kits"))


def _hal_message(exc: BaseException) -> bool:
    """An exception hal wrote for the user: raised by hal's code with a message naming hal."""
    text = str(exc)
    if "hal" not in text:
        return False
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return last is None or last.startswith(_HAL_FILES) or "hal" in text.split(":", 1)[0]


def judge_exception(exc: BaseException, ref: Optional[BaseException] = None, own: tuple = ()) -> tuple[str, str]:
    """clear or raw for an exception raised by hal (``ref``: what the reference raised for the same
    input; ``own``: exception classes the user's own code raised, passed through)."""
    import hal

    what = f"{type(exc).__name__}: {str(exc)[:300]}"
    if isinstance(exc, hal.HalError):
        return "clear", what
    if own and isinstance(exc, own):
        return "clear", "the user's own exception: " + what
    if isinstance(exc, TypeError) and any(s in str(exc) for s in ("unexpected keyword argument", "required positional argument",
                                                                  "required keyword-only argument", "positional arguments but")):
        return "clear", "Python's own message for a call that does not match the signature: " + what
    if ref is not None and (isinstance(exc, type(ref)) or (isinstance(exc, (IndexError, ValueError, TypeError, RuntimeError))
                                                          and type(ref) is type(exc))):
        return "clear", "as torch: " + what
    if _hal_message(exc) and not isinstance(exc, (AttributeError, KeyError, NameError, UnboundLocalError, AssertionError,
                                                   ZeroDivisionError, RecursionError)):
        return "clear", what
    return "raw", what + " @ " + _where(exc)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _capture(fn: Callable[[], Any]) -> tuple[Any, Optional[BaseException]]:
    try:
        return fn(), None
    except Verdict:
        raise
    except Exception as exc:  # noqa: BLE001 - classified by the caller
        return None, exc


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    return [value]


def differs(got: Any, want: Any, atol: float, rtol: float) -> Optional[str]:
    """Why ``got`` differs from ``want`` (None when they agree): type, shape, dtype, NaN/Inf
    positions, values beyond atol + rtol * |want|."""
    import numpy as np
    import torch

    g_all, w_all = _leaves(got), _leaves(want)
    if len(g_all) != len(w_all):
        return f"{len(g_all)} results where the reference has {len(w_all)}"
    for i, (g, w) in enumerate(zip(g_all, w_all)):
        if w is None or g is None:
            if (w is None) != (g is None):
                return f"result {i}: {type(g).__name__} where the reference has {type(w).__name__}"
            continue
        if isinstance(w, (int, float, bool)) and not isinstance(w, torch.Tensor):
            w = torch.tensor(w)
            g = torch.as_tensor(g) if not isinstance(g, torch.Tensor) else g
        if isinstance(w, np.ndarray) != isinstance(g, np.ndarray):
            return f"result {i}: {type(g).__name__} where the reference has {type(w).__name__}"
        g_t = torch.from_numpy(np.ascontiguousarray(g)) if isinstance(g, np.ndarray) else g
        w_t = torch.from_numpy(np.ascontiguousarray(w)) if isinstance(w, np.ndarray) else w
        if not isinstance(g_t, torch.Tensor):
            return f"result {i}: a {type(g).__name__}, not an array"
        if tuple(g_t.shape) != tuple(w_t.shape):
            return f"result {i}: shape {tuple(g_t.shape)} where the reference has {tuple(w_t.shape)}"
        if g_t.dtype != w_t.dtype:
            return f"result {i}: dtype {g_t.dtype} where the reference has {w_t.dtype}"
        if g_t.device != w_t.device:
            return f"result {i}: device {g_t.device} where the reference has {w_t.device}"
        if g_t.is_meta or g_t.numel() == 0:
            continue
        gd, wd = g_t.detach().double(), w_t.detach().double()
        if not torch.equal(torch.isnan(gd), torch.isnan(wd)):
            return f"result {i}: NaN at {int((torch.isnan(gd) != torch.isnan(wd)).sum())} places where the reference differs"
        inf_g, inf_w = torch.isinf(gd), torch.isinf(wd)
        if not torch.equal(inf_g, inf_w) or not torch.equal(gd[inf_g], wd[inf_w]):
            return f"result {i}: infinities differ from the reference's"
        fin = torch.isfinite(wd)
        err = (gd[fin] - wd[fin]).abs()
        bound = atol + rtol * wd[fin].abs()
        if err.numel() and bool((err > bound).any()):
            worst = int((err - bound).argmax())
            return (f"result {i}: max abs error {float(err.max()):.3g} (at a value {float(wd[fin][worst]):.4g}, got "
                    f"{float(gd[fin][worst]):.4g}); atol {atol:g}, rtol {rtol:g}")
    return None


def compare(hal_fn: Callable[[], Any], ref_fn: Callable[[], Any], atol: float = 1e-5, rtol: float = 1e-4,
            refused_ok: bool = False, own: tuple = ()) -> tuple[str, str]:
    """Run the reference, then hal, and classify hal's outcome against it."""
    want, ref_exc = _capture(ref_fn)
    got, exc = _capture(hal_fn)
    if exc is not None:
        status, what = judge_exception(exc, ref_exc, own)
        if status == "clear" and ref_exc is None and not refused_ok:
            what = "refused where the reference runs: " + what
        return status, what
    if ref_exc is not None:
        return "silent", f"accepted where the reference raises {type(ref_exc).__name__}: {str(ref_exc)[:200]}"
    why = differs(got, want, atol, rtol)
    return ("silent", why) if why else ("correct", "")


def refused(hal_fn: Callable[[], Any], own: tuple = ()) -> tuple[str, str]:
    """Bad input that must be refused: a result is silent, a hal error clear, anything else raw."""
    got, exc = _capture(hal_fn)
    if exc is None:
        return "silent", f"bad input accepted (returned {type(got).__name__})"
    return judge_exception(exc, None, own)


def holds(hal_fn: Callable[[], Any]) -> tuple[str, str]:
    """``hal_fn`` runs and returns True (correct) or a string saying what is wrong (silent)."""
    got, exc = _capture(hal_fn)
    if exc is not None:
        status, what = judge_exception(exc)
        return status, ("refused valid input: " + what) if status == "clear" else what
    if got is True or got is None:
        return "correct", ""
    return "silent", str(got)


def _seeded(seed: int, salt: str) -> int:
    import zlib

    return (seed * 1000003 + zlib.crc32(salt.encode())) % (2**31 - 1)


def gen(salt: str) -> "Any":
    import torch

    return torch.Generator().manual_seed(_seeded(SEED[0], salt))


SEED = [41]


def randn(g: Any, *shape: int, dtype: Any = None, lo: float = 0.0) -> Any:
    """Normal numbers, never zero (|x| >= 1e-3 moved away from 0)."""
    import torch

    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x)
    return (x + lo).to(dtype or torch.float32)


def rand_pos(g: Any, *shape: int, dtype: Any = None) -> Any:
    import torch

    return (torch.rand(*shape, generator=g, dtype=torch.float64) + 0.5).to(dtype or torch.float32)


# ----------------------------------------------------------------------------------------------------
# numerics: every op at the edges, against torch
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OpSpec:
    """One op call: ``make(g, dtype, n)`` draws its inputs (a list; ``n`` the batch size of the main
    input), ``hal`` and ``ref`` compute on such a list. ``main``: the input the edges change;
    ``grads``: inputs autograd is checked for; ``floats``: inputs of the compute dtype."""

    name: str
    make: Callable[[Any, Any, int], list]
    hal: Callable[[list], Any]
    ref: Callable[[list], Any]
    main: int = 0
    grads: tuple = ()
    second: Optional[int] = None  # another float input (weight): the mixed-dtype edge makes it float64
    edges: Optional[tuple] = None  # None: every edge
    atol: float = 2e-5
    rtol: float = 1e-4


def _op_specs() -> list[OpSpec]:
    import torch
    import torch.nn.functional as F

    import hal

    o = hal.ops

    def rot_ref(a: list) -> Any:
        x, cos, sin = a
        d = x.shape[-1] // 2
        x1, x2 = x[..., :d], x[..., d:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    def rot_inter_ref(a: list) -> Any:
        x, cos, sin = a
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        return out.flatten(-2)

    def target(g: Any, n: int, c: int) -> Any:
        t = torch.randint(0, c, (n,), generator=g)
        if n > 2:
            t[1] = -100
        return t

    def gg_sizes(n: int) -> Any:
        a = n // 3
        b = n // 4
        return torch.tensor([a, 0, b, n - a - b], dtype=torch.int64)

    def gg_ref(a: list) -> Any:
        x, w, sizes = a
        outs, start = [], 0
        for gi, s in enumerate(sizes.tolist()):
            outs.append(x[start:start + s] @ w[gi])
            start += s
        return torch.cat(outs, 0)

    def q_ref(a: list) -> Any:
        x = a[0].float()
        code = torch.round(x / 0.05) + 3  # round half to even
        code = torch.where(torch.isnan(code), torch.full_like(code, 127.0), code)
        return code.clamp(-128, 127).to(torch.int8)

    def bn_train_hal(a: list) -> Any:
        x, rm, rv, w, b = a
        rm, rv = rm.clone(), rv.clone()
        y = o.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2, eps=1e-5)
        return y, rm, rv

    def bn_train_ref(a: list) -> Any:
        x, rm, rv, w, b = a
        rm, rv = rm.clone(), rv.clone()
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2, eps=1e-5)
        return y, rm, rv

    def unscale_hal(a: list) -> Any:
        t1, t2 = a[0].clone(), a[1].clone()
        flag = o.amp_unscale_([t1, t2], 0.25)
        return t1, t2, flag

    def unscale_ref(a: list) -> Any:
        t1, t2 = a[0].clone(), a[1].clone()
        found = torch.zeros((), dtype=torch.float32)
        torch._amp_foreach_non_finite_check_and_unscale_([t1, t2], found, torch.tensor(0.25))
        return t1, t2, found

    def adamw_hal(a: list) -> Any:
        p, g_, m, v = (t.clone() for t in a)
        o.fused_adamw_([p], [g_], [m], [v], lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, step=3)
        return p, m, v

    def adamw_ref(a: list) -> Any:
        p, g_, m, v = (t.clone() for t in a)
        if g_.dtype != p.dtype or m.dtype != p.dtype or len({t.shape for t in (p, g_, m, v)}) > 1 or p.is_meta:
            raise RuntimeError("dtypes or shapes differ")  # torch's fused CPU kernel corrupts the heap on such input
        torch._fused_adamw_([p], [g_], [m], [v], [], [torch.tensor(3.0)], lr=0.01, beta1=0.9, beta2=0.99,
                            weight_decay=0.05, eps=1e-8, amsgrad=False, maximize=False)
        return p, m, v

    def fcbr_ref(a: list) -> Any:
        x, w, cb, bw, bb, rm, rv = a
        return F.relu(F.batch_norm(F.conv2d(x, w, cb, padding=1), rm, rv, bw, bb, False, 0.1, 1e-5))

    S = OpSpec
    return [
        S("softmax", lambda g, dt, n: [randn(g, n, 7, dtype=dt)], lambda a: o.softmax(a[0], -1), lambda a: F.softmax(a[0], -1),
          grads=(0,)),
        S("softmax_dim0", lambda g, dt, n: [randn(g, n, 5, dtype=dt)], lambda a: o.softmax(a[0], 0), lambda a: F.softmax(a[0], 0)),
        S("layer_norm", lambda g, dt, n: [randn(g, n, 3, 8, dtype=dt), rand_pos(g, 8, dtype=dt), randn(g, 8, dtype=dt)],
          lambda a: o.layer_norm(a[0], (8,), a[1], a[2], 1e-5), lambda a: F.layer_norm(a[0], (8,), a[1], a[2], 1e-5),
          grads=(0, 1, 2), second=1),
        S("rms_norm", lambda g, dt, n: [randn(g, n, 8, dtype=dt), rand_pos(g, 8, dtype=dt)],
          lambda a: o.rms_norm(a[0], (8,), a[1], 1e-6), lambda a: F.rms_norm(a[0], (8,), a[1], 1e-6), grads=(0, 1), second=1),
        S("linear_gelu", lambda g, dt, n: [randn(g, n, 6, dtype=dt), randn(g, 5, 6, dtype=dt), randn(g, 5, dtype=dt)],
          lambda a: o.linear(a[0], a[1], a[2], act="gelu"), lambda a: F.gelu(F.linear(a[0], a[1], a[2])), grads=(0, 1, 2), second=1),
        S("linear", lambda g, dt, n: [randn(g, n, 2, 6, dtype=dt), randn(g, 5, 6, dtype=dt)],
          lambda a: o.linear(a[0], a[1]), lambda a: F.linear(a[0], a[1]), grads=(0, 1), second=1),
        S("matmul", lambda g, dt, n: [randn(g, n, 4, 6, dtype=dt), randn(g, 6, 5, dtype=dt)],
          lambda a: o.matmul(a[0], a[1]), lambda a: torch.matmul(a[0], a[1]), grads=(0, 1), second=1),
        S("scale_shift_act", lambda g, dt, n: [randn(g, n, 6, dtype=dt), randn(g, 6, dtype=dt)],
          lambda a: o.scale_shift_act(a[0], a[1], 0.3, act="silu"),
          lambda a: F.silu(a[0] * a[1] + 0.3).to(a[0].dtype) if a[0].is_floating_point() else F.silu(a[0] * a[1] + 0.3),
          grads=(0, 1), second=1),  # documented: the result has x's dtype
        S("conv2d", lambda g, dt, n: [randn(g, n, 3, 6, 6, dtype=dt), randn(g, 4, 3, 3, 3, dtype=dt), randn(g, 4, dtype=dt)],
          lambda a: o.conv2d(a[0], a[1], a[2], padding=1), lambda a: F.conv2d(a[0], a[1], a[2], padding=1), grads=(0, 1, 2),
          second=1, atol=1e-4),
        S("conv2d_same_strided", lambda g, dt, n: [randn(g, n, 2, 7, 7, dtype=dt), randn(g, 4, 1, 3, 3, dtype=dt)],
          lambda a: o.conv2d(a[0], a[1], None, 1, "same", 2, 2), lambda a: F.conv2d(a[0], a[1], None, 1, "same", 2, 2),
          grads=(0, 1), second=1, atol=1e-4),
        S("batch_norm_eval", lambda g, dt, n: [randn(g, n, 4, 5, dtype=dt), randn(g, 4, dtype=dt), rand_pos(g, 4, dtype=dt),
                                                randn(g, 4, dtype=dt), randn(g, 4, dtype=dt)],
          lambda a: o.batch_norm(a[0], a[1], a[2], a[3], a[4], False, 0.1, 1e-5),
          lambda a: F.batch_norm(a[0], a[1], a[2], a[3], a[4], False, 0.1, 1e-5), grads=(0, 3, 4), second=3),
        S("batch_norm_train", lambda g, dt, n: [randn(g, n, 4, 5, dtype=dt), randn(g, 4, dtype=dt), rand_pos(g, 4, dtype=dt),
                                                 randn(g, 4, dtype=dt), randn(g, 4, dtype=dt)],
          bn_train_hal, bn_train_ref, grads=(0, 3, 4), second=3, atol=1e-4),
        S("fused_conv_bn_relu", lambda g, dt, n: [randn(g, n, 3, 5, 5, dtype=dt), randn(g, 4, 3, 3, 3, dtype=dt), randn(g, 4, dtype=dt),
                                                   rand_pos(g, 4, dtype=dt), randn(g, 4, dtype=dt), randn(g, 4, dtype=dt),
                                                   rand_pos(g, 4, dtype=dt)],
          lambda a: o.fused_conv_bn_relu(*a, padding=1), fcbr_ref, grads=(0, 1, 3, 4), second=1, atol=1e-4),
        S("sdpa_causal", lambda g, dt, n: [randn(g, n, 2, 5, 8, dtype=dt), randn(g, n, 2, 5, 8, dtype=dt), randn(g, n, 2, 5, 8, dtype=dt)],
          lambda a: o.scaled_dot_product_attention(a[0], a[1], a[2], is_causal=True),
          lambda a: F.scaled_dot_product_attention(a[0], a[1], a[2], is_causal=True), grads=(0, 1, 2), second=1),
        S("sdpa_mask", lambda g, dt, n: [randn(g, n, 2, 5, 8, dtype=dt), randn(g, n, 2, 6, 8, dtype=dt), randn(g, n, 2, 6, 8, dtype=dt),
                                          randn(g, 5, 6, dtype=dt)],
          lambda a: o.scaled_dot_product_attention(a[0], a[1], a[2], a[3], scale=0.3),
          lambda a: F.scaled_dot_product_attention(a[0], a[1], a[2], a[3], scale=0.3), grads=(0, 1, 2), second=1),
        S("rotary", lambda g, dt, n: [randn(g, n, 2, 5, 8, dtype=dt), randn(g, 5, 4, dtype=dt), randn(g, 5, 4, dtype=dt)],
          lambda a: o.rotary_embedding(a[0], a[1], a[2]), rot_ref, grads=(0,), second=1),
        S("rotary_interleaved", lambda g, dt, n: [randn(g, n, 5, 6, dtype=dt), randn(g, 5, 3, dtype=dt), randn(g, 5, 3, dtype=dt)],
          lambda a: o.rotary_embedding(a[0], a[1], a[2], interleaved=True), rot_inter_ref, grads=(0,), second=1),
        S("swiglu", lambda g, dt, n: [randn(g, n, 6, dtype=dt), randn(g, n, 6, dtype=dt)],
          lambda a: o.swiglu(a[0], a[1]), lambda a: F.silu(a[0]) * a[1], grads=(0, 1), second=1),
        S("cross_entropy", lambda g, dt, n: [randn(g, n, 7, dtype=dt), target(g, n, 7)],
          lambda a: o.cross_entropy(a[0], a[1], label_smoothing=0.1),
          lambda a: F.cross_entropy(a[0].float() if a[0].dtype == torch.bfloat16 else a[0], a[1], label_smoothing=0.1),
          grads=(0,)),  # documented: the loss is float32 for half-precision logits
        S("cross_entropy_sum", lambda g, dt, n: [randn(g, n, 7, dtype=dt), target(g, n, 7)],
          lambda a: o.cross_entropy(a[0], a[1], reduction="sum"),
          lambda a: F.cross_entropy(a[0].float() if a[0].dtype == torch.bfloat16 else a[0], a[1], reduction="sum"),
          grads=(0,)),
        S("linear_cross_entropy", lambda g, dt, n: [randn(g, n, 6, dtype=dt), randn(g, 7, 6, dtype=dt), target(g, n, 7)],
          lambda a: o.linear_cross_entropy(a[0], a[1], a[2]),
          lambda a: F.cross_entropy(F.linear(a[0], a[1]).float() if a[0].dtype == torch.bfloat16 else F.linear(a[0], a[1]), a[2]),
          grads=(0, 1), second=1),
        S("grouped_gemm", lambda g, dt, n: [randn(g, n, 4, dtype=dt), randn(g, 4, 4, 3, dtype=dt), gg_sizes(n)],
          lambda a: o.grouped_gemm(a[0], a[1], a[2]), gg_ref, grads=(0, 1), second=1),
        S("quantize", lambda g, dt, n: [randn(g, n, 6, dtype=dt) * 4], lambda a: o.quantize(a[0], 0.05, 3), q_ref,
          atol=1.0, rtol=0.0),
        S("fake_quantize", lambda g, dt, n: [randn(g, n, 6, dtype=dt)], lambda a: o.fake_quantize(a[0], 0.05, 3),
          lambda a: torch.fake_quantize_per_tensor_affine(a[0], 0.05, 3, -128, 127), grads=(0,), atol=1e-6),
        S("amp_unscale_", lambda g, dt, n: [randn(g, n, 5, dtype=dt), randn(g, 3, dtype=dt)], unscale_hal, unscale_ref, second=1),
        S("fused_adamw_", lambda g, dt, n: [randn(g, n, 5, dtype=dt), randn(g, n, 5, dtype=dt), randn(g, n, 5, dtype=dt) * 0.1,
                                             rand_pos(g, n, 5, dtype=dt) * 0.01],
          adamw_hal, adamw_ref, second=1, atol=1e-6),
    ]


EDGES = ("base", "float64", "bfloat16", "nan", "inf", "empty", "noncontig", "overlap", "int64", "mixed", "shape", "numpy",
         "grad", "meta")


def _noncontig(t: Any) -> Any:
    """The same values as ``t`` in a non-contiguous view (every other element of a wider buffer)."""
    import torch

    if t.dim() == 0:
        return t
    wide = torch.empty(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _overlapping(t: Any) -> Any:
    """A view whose rows all alias one row (stride 0 on the first dim): values the same for both."""
    if t.dim() == 0 or t.shape[0] == 0:
        return t
    return t[:1].expand(t.shape)


def _numerics_attacks() -> list[Attack]:
    out = []
    specs = _op_specs()
    for spec in specs:
        for edge in EDGES:
            out.append(Attack("numerics", f"{spec.name}[{edge}]", _numerics_case(spec, edge),
                              quick=edge in ("nan", "overlap", "int64", "empty")))
    return out


def _numerics_case(spec: OpSpec, edge: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import numpy as np
        import torch

        g = gen(f"{spec.name}/{edge}")
        dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(edge, torch.float32)
        n = 0 if edge == "empty" else 6
        a = spec.make(g, dtype, n)
        atol, rtol = spec.atol, spec.rtol
        if edge == "bfloat16":
            atol, rtol = max(atol, 5e-2), 5e-2
        refused_ok = False
        m = spec.main
        if edge in ("nan", "inf"):
            x = a[m].clone()
            if not x.is_floating_point() or x.numel() < 3:
                raise Verdict("correct", "not applicable")
            flat = x.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[:2]
            if edge == "nan":
                flat[idx] = float("nan")
            else:
                flat[idx[0]], flat[idx[1]] = float("inf"), float("-inf")
            a[m] = x
        elif edge == "noncontig":
            a = [_noncontig(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in a]
        elif edge == "overlap":
            a[m] = _overlapping(a[m])
        elif edge == "int64":
            a[m] = (a[m] * 3).to(torch.int64)
        elif edge == "mixed":
            if spec.second is None:
                raise Verdict("correct", "not applicable")
            a[spec.second] = a[spec.second].double()
            refused_ok = True  # torch refuses most mixes; hal may refuse where torch promotes
        elif edge == "shape":
            x = a[m]
            a[m] = torch.cat([x, x[..., :1]], -1) if x.dim() else x
        elif edge == "meta":
            a = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in a]
            refused_ok = True
        if edge == "numpy":
            if spec.name in ("amp_unscale_", "fused_adamw_", "batch_norm_train"):
                raise Verdict("correct", "not applicable (in place on clones)")
            arrays = [t.numpy() if isinstance(t, torch.Tensor) else t for t in a]
            want = spec.ref(a)
            want = tuple(w.numpy() for w in want) if isinstance(want, tuple) else want.numpy()
            return compare(lambda: spec.hal(arrays), lambda: want, atol, rtol)
        if edge == "grad":
            if not spec.grads:
                raise Verdict("correct", "not applicable")
            return _grad_compare(spec, a, atol, rtol)
        if edge == "inf":  # torch's own float32 kernels disagree at +-inf (vectorised gelu(inf) is NaN, its scalar
            # path and float64 give inf): the reference is torch in float64, rounded to the inputs' dtype
            def ref() -> Any:
                wide = spec.ref([t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in a])
                def back(w: Any) -> Any:
                    return w.to(dtype) if w.dtype == torch.float64 else w
                return tuple(back(w) for w in wide) if isinstance(wide, tuple) else back(wide)
            status, detail = compare(lambda: spec.hal(a), ref, atol, rtol)
            if status == "silent":  # as torch's own float32 kernels do is correct too
                again = compare(lambda: spec.hal(a), lambda: spec.ref(a), atol, rtol)
                if again[0] == "correct":
                    return "correct", "as torch's float32 kernels (torch in float64 differs at +-inf: " + detail + ")"
            return status, detail
        return compare(lambda: spec.hal(a), lambda: spec.ref(a), atol, rtol, refused_ok=refused_ok)

    return run


def _grad_compare(spec: OpSpec, a: list, atol: float, rtol: float) -> tuple[str, str]:
    import torch

    def run(fn: Callable[[list], Any]) -> Any:
        inputs = [t.detach().clone().requires_grad_(i in spec.grads) if isinstance(t, torch.Tensor) else t for i, t in enumerate(a)]
        out = fn(inputs)
        first = out[0] if isinstance(out, tuple) else out
        weights = torch.linspace(0.5, 1.5, first.numel(), dtype=first.dtype).reshape(first.shape)
        (first * weights).sum().backward()
        return [first.detach()] + [inputs[i].grad for i in spec.grads]

    return compare(lambda: run(spec.hal), lambda: run(spec.ref), atol * 10, rtol * 10)


# ----------------------------------------------------------------------------------------------------
# running: workers per group, resumed after the attack that killed them
# ----------------------------------------------------------------------------------------------------

BUILDERS: dict[str, Callable[[], list[Attack]]] = {}


def builder(cls: str) -> Callable[[Callable[[], list[Attack]]], Callable[[], list[Attack]]]:
    def register(fn: Callable[[], list[Attack]]) -> Callable[[], list[Attack]]:
        BUILDERS[cls] = fn
        return fn
    return register


BUILDERS["numerics"] = _numerics_attacks


def attacks_of(classes: list[str], quick: bool) -> list[Attack]:
    out = []
    for cls in classes:
        out += [a for a in BUILDERS[cls]() if a.quick or not quick]
    return out


def _worker(group: str, classes: list[str], start: int, quick: bool) -> None:
    """Run the group's attacks from ``start``, reporting each on stdout (``@@START i`` and
    ``@@RESULT {json}``); anything else the attacks print goes to stderr."""
    real = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # attack output and warnings away from the protocol
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.CRITICAL)
    import torch

    torch.set_num_threads(1)
    QUICK[0] = quick
    attacks = attacks_of([c for c in classes if CLASSES[c] == group], quick)
    for i in range(start, len(attacks)):
        attack = attacks[i]
        real.write(f"@@START {i} {attack.timeout_s}\n")
        real.flush()
        began = time.monotonic()
        try:
            status, detail = attack.fn()
        except Verdict as v:
            status, detail = v.status, v.detail
        except Exception as exc:  # noqa: BLE001 - a bug of the attack or an error it did not expect
            status, detail = judge_exception(exc)
            detail = "(uncaught by the attack) " + detail
        real.write("@@RESULT " + json.dumps({"i": i, "id": attack.id, "status": status, "detail": str(detail)[:1500],
                                             "seconds": round(time.monotonic() - began, 3)}) + "\n")
        real.flush()
    real.write("@@DONE\n")
    real.flush()
    real.close()
    os._exit(0)


def _run_group(group: str, classes: list[str], quick: bool, seed: int, verbose: bool, log: Any) -> list[dict]:
    names = [a.id for a in attacks_of([c for c in classes if CLASSES[c] == group], quick)]
    results: list[dict] = []
    start = 0
    while start < len(names):
        cmd = [sys.executable, __file__, "--worker", group, "--start", str(start), "--seed", str(seed),
               "--classes", ",".join(classes)] + (["--quick"] if quick else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=_worker_env(),
                                start_new_session=True)
        current, deadline, done = None, time.monotonic() + 300, False
        assert proc.stdout is not None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:  # hung
                _kill(proc)
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("@@START "):
                _, i, timeout = line.split()
                current, deadline = int(i), time.monotonic() + float(timeout)
            elif line.startswith("@@RESULT "):
                record = json.loads(line[len("@@RESULT "):])
                results.append(record)
                current, start = None, record["i"] + 1
                if verbose or record["status"] in BAD:
                    print(f"  {record['status']:8s} {record['id']}  {record['detail'][:160]}", flush=True)
            elif line.startswith("@@DONE"):
                done = True
        code = proc.wait()
        if done:
            break
        crashed = current if current is not None else start
        how = f"exit status {code}" if code is not None and code >= 0 else f"killed by signal {-code}"
        if time.monotonic() >= deadline:
            how = "no result within the attack's time limit (hung)"
        record = {"i": crashed, "id": names[crashed], "status": "crash", "detail": how, "seconds": None}
        results.append(record)
        print(f"  crash    {record['id']}  {how}", flush=True)
        start = crashed + 1
    return results


def _kill(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _worker_env() -> dict:
    env = dict(os.environ)
    env.setdefault("HAL_TUNE", "off")  # the tuning class sets its own; timings are not what is attacked elsewhere
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast subset of every class")
    parser.add_argument("--json", metavar="OUT", help="write every outcome as JSON")
    parser.add_argument("--classes", default=",".join(CLASSES), help="comma-separated: " + ", ".join(CLASSES))
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--jobs", type=int, default=2, help="worker groups run at once")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every outcome, not only the bad ones")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    SEED[0] = args.seed
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    unknown = [c for c in classes if c not in CLASSES]
    if unknown:
        parser.error(f"unknown classes {unknown}; known: {', '.join(CLASSES)}")
    if args.worker:
        _worker(args.worker, classes, args.start, args.quick)
        return 0
    began = time.monotonic()
    groups = list(dict.fromkeys(CLASSES[c] for c in classes))
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="attacks41-") as tmp:
        logs = {g: open(Path(tmp) / f"{g}.log", "w") for g in groups}
        pending = queue.Queue()
        for g in groups:
            pending.put(g)

        def work() -> None:
            while True:
                try:
                    g = pending.get_nowait()
                except queue.Empty:
                    return
                t0 = time.monotonic()
                results[g] = _run_group(g, classes, args.quick, args.seed, args.verbose, logs[g])
                print(f"[{g}: {len(results[g])} attacks in {time.monotonic() - t0:.0f} s]", flush=True)

        threads = [threading.Thread(target=work) for _ in range(max(1, args.jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    every = [r for g in groups for r in results.get(g, [])]
    counts = {c: collections.Counter() for c in classes}
    for r in every:
        counts[r["id"].split("/", 1)[0]][r["status"]] += 1
    total = collections.Counter(r["status"] for r in every)
    print(f"\n{'class':10s} " + " ".join(f"{s:>8s}" for s in STATUSES) + "    total")
    for c in classes:
        print(f"{c:10s} " + " ".join(f"{counts[c][s]:8d}" for s in STATUSES) + f"    {sum(counts[c].values()):5d}")
    print(f"{'all':10s} " + " ".join(f"{total[s]:8d}" for s in STATUSES) + f"    {len(every):5d}")
    bad = [r for r in every if r["status"] in BAD]
    if bad:
        print("\nsilent wrong results, raw exceptions and crashes:")
        for r in bad:
            print(f"  {r['status']:7s} {r['id']}: {r['detail']}")
    print(f"\n{len(every)} attacks in {time.monotonic() - began:.0f} s (seed {args.seed}{', quick' if args.quick else ''})")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "quick": args.quick, "commit": _commit(),
                                               "counts": {c: dict(counts[c]) for c in classes}, "total": dict(total),
                                               "results": every}, indent=1))
    return 1 if bad else 0


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------------------------------
# optim: hal.optim.AdamW's state <-> torch.optim.AdamW's, both ways
# ----------------------------------------------------------------------------------------------------


def _params(g: Any, shapes: tuple, dtype: Any = None) -> list:
    import torch

    return [torch.nn.Parameter(randn(g, *s, dtype=dtype)) for s in shapes]


def _grads(params: list, g: Any) -> None:
    for p in params:
        p.grad = randn(g, *p.shape, dtype=p.dtype)


def _roundtrip(shapes: tuple, first: str, steps_a: int, steps_b: int, groups: int = 1, dtype: Any = None,
               torch_opts: Optional[dict] = None, frozen: bool = False, **opts: Any) -> Callable[[], tuple[str, str]]:
    """``steps_a`` steps with ``first`` ("hal" or "torch"), its state_dict saved through torch.save and
    loaded into the other, ``steps_b`` more there; against torch.optim.AdamW all along."""
    def run() -> tuple[str, str]:
        import torch

        import hal.optim

        g = gen(f"optim/{shapes}/{first}/{groups}/{opts}/{torch_opts}/{frozen}")
        ref_params = _params(g, shapes, dtype)
        mine = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]

        def grouped(ps: list) -> list:
            if groups == 1:
                return [{"params": ps}]
            return [{"params": ps[i::groups], "lr": 0.01 * (i + 1), "weight_decay": 0.02 * i} for i in range(groups)]

        kwargs = dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, **opts)
        ref = torch.optim.AdamW(grouped(ref_params), **kwargs, **(torch_opts or {}))
        make = {"hal": lambda ps: hal.optim.AdamW(grouped(ps), **kwargs),
                "torch": lambda ps: torch.optim.AdamW(grouped(ps), **kwargs, **(torch_opts or {}))}
        other = "torch" if first == "hal" else "hal"
        opt = make[first](mine)
        gg = gen("grads")
        for step in range(steps_a + steps_b):
            if step == steps_a:
                buffer = io.BytesIO()
                torch.save(opt.state_dict(), buffer)
                buffer.seek(0)
                opt = make[other](mine)
                opt.load_state_dict(torch.load(buffer, weights_only=False))
            grads = [randn(gg, *p.shape, dtype=p.dtype) for p in mine]
            for i, (a, b, gr) in enumerate(zip(mine, ref_params, grads)):
                skip = frozen and i == 0 and step % 2 == 1
                a.grad = None if skip else gr.clone()
                b.grad = None if skip else gr.clone()
            opt.step()
            ref.step()
        tol = 1e-5 if (dtype is None or dtype == torch.float32) else 3e-2
        why = differs([p.detach() for p in mine], [p.detach() for p in ref_params], tol, tol)
        if why:
            return "silent", why
        steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
        want = [float(s["step"]) for s in ref.state_dict()["state"].values()]
        return ("correct", "") if steps == want else ("silent", f"step counts {steps}, torch's {want}")

    return run


def _load_foreign(torch_opts: dict) -> Callable[[], tuple[str, str]]:
    """A torch.optim.AdamW state with an option hal's AdamW does not have (amsgrad, maximize ...):
    loading it into hal's AdamW and stepping must continue as torch would, or refuse."""
    def run() -> tuple[str, str]:
        import torch

        import hal.optim

        g = gen(f"foreign/{torch_opts}")
        ref_params = _params(g, ((4, 3), (3,)))
        mine = [torch.nn.Parameter(p.detach().clone()) for p in ref_params]
        ref = torch.optim.AdamW(ref_params, lr=0.05, **torch_opts)
        for _ in range(2):
            _grads(ref_params, g)
            ref.step()
        for a, b in zip(mine, ref_params):
            a.data.copy_(b.data)
        opt = hal.optim.AdamW(mine, lr=0.05)

        def go() -> Any:
            import copy

            opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # a live state_dict shares torch's tensors
            for _ in range(2):
                grads = [randn(g, *p.shape) for p in ref_params]
                for a, b, gr in zip(mine, ref_params, grads):
                    a.grad, b.grad = gr.clone(), gr.clone()
                opt.step()
                ref.step()
            return [p.detach() for p in mine]

        return compare(go, lambda: [p.detach() for p in ref_params], 1e-5, 1e-5)

    return run


def _optim_misuse(name: str) -> Callable[[], tuple[str, str]]:
    """Misuses whose reference is torch.optim.AdamW doing the same."""
    def run() -> tuple[str, str]:
        import torch

        import hal.optim

        g = gen("misuse/" + name)
        ps = _params(g, ((3, 2), (2,)))
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]

        def act(cls: Any, params: list) -> Any:
            if name == "lr_negative":
                return cls(params, lr=-1.0)
            if name == "beta_one":
                return cls(params, betas=(1.0, 0.9))
            if name == "eps_negative":
                return cls(params, eps=-1e-8)
            if name == "wd_negative":
                return cls(params, weight_decay=-0.1)
            if name == "param_twice":
                opt = cls([params[0], params[0]])
                params[0].grad = torch.ones_like(params[0])
                opt.step()
                return params[0].detach()
            if name == "no_params":
                return cls([])
            if name == "not_leaf":
                return cls([params[0] * 2])
            if name == "state_of_other_size":
                other = torch.optim.AdamW([torch.nn.Parameter(torch.ones(5))])
                other.step()
                opt = cls(params)
                opt.load_state_dict(other.state_dict())
                return opt
            if name == "state_of_other_shape":
                twin = [torch.nn.Parameter(randn(gen("shape"), 2, 3)), torch.nn.Parameter(randn(gen("shape2"), 2))]
                other = torch.optim.AdamW(twin)
                for t in twin:
                    t.grad = torch.ones_like(t)
                other.step()
                opt = cls(params)
                opt.load_state_dict(other.state_dict())
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
                return [p.detach() for p in params]
            if name == "lr_tensor":
                opt = cls(params, lr=torch.tensor(0.01))
                for p in params:
                    p.grad = torch.ones_like(p) * 0.5
                opt.step()
                return [p.detach() for p in params]
            if name == "sparse_grad":
                opt = cls(params)
                params[1].grad = torch.sparse_coo_tensor([[0]], [1.0], (2,))
                params[0].grad = torch.ones_like(params[0])
                opt.step()
                return [p.detach() for p in params]
            if name == "complex_param":
                cp = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64, generator=gen("c")))
                opt = cls([cp], lr=0.1)
                cp.grad = torch.ones_like(cp)
                opt.step()
                return cp.detach()
            if name == "grad_of_other_dtype":
                opt = cls(params)
                params[0].grad = torch.ones(params[0].shape, dtype=torch.float64)
                opt.step()
                return params[0].detach()
            if name == "closure":
                opt = cls(params)

                def closure() -> Any:
                    opt.zero_grad()
                    loss = (params[0] ** 2).sum() + params[1].sum()
                    loss.backward()
                    return loss
                loss = opt.step(closure)
                return [loss.detach()] + [p.detach() for p in params]
            if name == "zero_grad_then_step":
                opt = cls(params)
                for p in params:
                    p.grad = torch.ones_like(p)
                opt.step()
                opt.zero_grad()
                opt.step()
                return [p.detach() for p in params]
            if name == "add_param_group":
                opt = cls([params[0]])
                opt.add_param_group({"params": [params[1]], "lr": 0.3})
                for p in params:
                    p.grad = torch.ones_like(p) * 0.7
                opt.step()
                opt.step()
                return [p.detach() for p in params]
            raise AssertionError(name)

        return compare(lambda: act(hal.optim.AdamW, ps), lambda: act(torch.optim.AdamW, qs), 1e-6, 1e-5, refused_ok=True)

    return run


@builder("optim")
def _optim_attacks() -> list[Attack]:
    import torch

    out = []
    for shapes in (((4, 3),), ((4, 3), (3,)), ((4, 3), (3,), (2, 2, 2), (5,))):
        for first in ("hal", "torch"):
            for steps in ((3, 1), (1, 3)):
                out.append(Attack("optim", f"roundtrip_{len(shapes)}p_{first}_first_{steps[0]}+{steps[1]}",
                                  _roundtrip(shapes, first, *steps), quick=steps == (3, 1) and len(shapes) == 2))
    out.append(Attack("optim", "roundtrip_groups_hal_first", _roundtrip(((4, 3), (3,), (2,)), "hal", 2, 2, groups=2)))
    out.append(Attack("optim", "roundtrip_groups_torch_first", _roundtrip(((4, 3), (3,), (2,)), "torch", 2, 2, groups=2)))
    out.append(Attack("optim", "roundtrip_frozen_hal_first", _roundtrip(((4, 3), (3,)), "hal", 3, 2, frozen=True)))
    out.append(Attack("optim", "roundtrip_frozen_torch_first", _roundtrip(((4, 3), (3,)), "torch", 3, 2, frozen=True)))
    out.append(Attack("optim", "roundtrip_float64", _roundtrip(((4, 3), (3,)), "hal", 2, 2, dtype=torch.float64)))
    out.append(Attack("optim", "roundtrip_bfloat16_torch_first", _roundtrip(((4, 3), (3,)), "torch", 2, 2, dtype=torch.bfloat16)))
    out.append(Attack("optim", "roundtrip_torch_foreach_first", _roundtrip(((4, 3), (3,)), "torch", 2, 2, torch_opts={"foreach": True})))
    out.append(Attack("optim", "roundtrip_eps_large", _roundtrip(((4, 3), (3,)), "hal", 2, 2, eps=0.1)))
    for opts in ({"amsgrad": True}, {"maximize": True}, {"foreach": True}, {"differentiable": False, "foreach": False},
                 {"fused": True}):
        out.append(Attack("optim", "torch_state_with_" + "_".join(f"{k}={v}" for k, v in opts.items()), _load_foreign(opts),
                          quick="amsgrad" in opts))
    for name in ("lr_negative", "beta_one", "eps_negative", "wd_negative", "param_twice", "no_params", "not_leaf",
                 "state_of_other_size", "state_of_other_shape", "lr_tensor", "sparse_grad", "complex_param",
                 "grad_of_other_dtype", "closure", "zero_grad_then_step", "add_param_group"):
        out.append(Attack("optim", name, _optim_misuse(name), quick=name in ("state_of_other_shape", "grad_of_other_dtype")))
    return out


# ----------------------------------------------------------------------------------------------------
# nn: hal.nn.fuse and hal.nn.patch against the model as given; Hugging Face models
# ----------------------------------------------------------------------------------------------------


def _structures() -> dict[str, Callable[[], Any]]:
    """name -> a function building a small model (its input drawn by :func:`_input_for`)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: Any) -> Any:
            h = self.lin(x)
            return F.relu(h) + h

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: Any) -> Any:
            return torch.relu(self.lin(torch.relu(self.lin(x))))

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 4)

        def forward(self, x: Any) -> Any:
            return F.silu(self.b(self.a(x).relu()))

    class InPlaceAfter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 6)

        def forward(self, x: Any) -> Any:
            y = F.gelu(self.lin(x))  # gelu's backward reads its input, not its result
            return y.add_(1.0)

    class ConvBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x: Any) -> Any:
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            y += x
            return self.relu(y)

    class BnUsedTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

        def forward(self, x: Any) -> Any:
            y = self.bn(self.conv(x))
            return F.relu(y) * y.sigmoid()

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(6, 6), nn.Linear(6, 6)
            self.register_buffer("scale", torch.full((6,), 1.5))

        def forward(self, x: Any) -> Any:
            return F.gelu(self.used(x)) * self.scale

    S = nn.Sequential
    lin = lambda i=6, o=6, **k: nn.Linear(i, o, **k)  # noqa: E731
    conv = lambda **k: nn.Conv2d(4, 4, 3, padding=1, **k)  # noqa: E731
    return {
        "lin_relu_lin": lambda: S(lin(), nn.ReLU(), lin(6, 3)),
        "lin_gelu": lambda: S(lin(), nn.GELU()),
        "lin_gelu_tanh": lambda: S(lin(), nn.GELU(approximate="tanh")),
        "lin_silu": lambda: S(lin(), nn.SiLU()),
        "lin_sigmoid": lambda: S(lin(), nn.Sigmoid()),
        "lin_tanh": lambda: S(lin(), nn.Tanh()),
        "lin_leaky": lambda: S(lin(), nn.LeakyReLU(0.1)),
        "lin_relu6": lambda: S(lin(), nn.ReLU6()),
        "lin_elu": lambda: S(lin(), nn.ELU()),
        "lin_relu_inplace": lambda: S(lin(), nn.ReLU(inplace=True)),
        "lin_nobias_gelu": lambda: S(lin(bias=False), nn.GELU()),
        "lin_dropout_relu": lambda: S(lin(), nn.Dropout(0.0), nn.ReLU()),
        "lin_bn1d_relu": lambda: S(lin(), nn.BatchNorm1d(6), nn.ReLU()),
        "lin_layernorm": lambda: S(lin(), nn.LayerNorm(6), nn.ReLU()),
        "lin_layernorm_nobias": lambda: S(lin(), nn.LayerNorm(6, bias=False)),
        "lin_layernorm_noaffine": lambda: S(lin(), nn.LayerNorm(6, elementwise_affine=False)),
        "lin_rmsnorm": lambda: S(lin(), nn.RMSNorm(6)),
        "lin_rmsnorm_noeps": lambda: S(lin(), nn.RMSNorm(6, eps=None)),
        "lin_rmsnorm_noaffine": lambda: S(lin(), nn.RMSNorm(6, elementwise_affine=False)),
        "nested_seq": lambda: S(S(lin(), nn.ReLU()), S(lin(), nn.Tanh())),
        "residual": Residual,
        "shared_linear": Shared,
        "functional": Functional,
        "inplace_after": InPlaceAfter,
        "unused_module": Unused,
        "conv_bn_relu": lambda: S(conv(), nn.BatchNorm2d(4), nn.ReLU()),
        "conv_bn": lambda: S(conv(), nn.BatchNorm2d(4)),
        "conv_nobias_bn_noaffine_relu": lambda: S(conv(bias=False), nn.BatchNorm2d(4, affine=False), nn.ReLU()),
        "conv_reflect_bn_relu": lambda: S(conv(padding_mode="reflect"), nn.BatchNorm2d(4), nn.ReLU()),
        "conv_circular_bn_relu": lambda: S(conv(padding_mode="circular"), nn.BatchNorm2d(4), nn.ReLU()),
        "conv_grouped_dilated_bn_relu": lambda: S(nn.Conv2d(4, 4, 3, stride=2, padding=2, dilation=2, groups=2), nn.BatchNorm2d(4),
                                                  nn.ReLU()),
        "conv_same_bn_relu": lambda: S(nn.Conv2d(4, 4, 3, padding="same"), nn.BatchNorm2d(4), nn.ReLU()),
        "conv_bn_nostats_relu": lambda: S(conv(), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU()),
        "conv_bn_cumulative_relu": lambda: S(conv(), nn.BatchNorm2d(4, momentum=None), nn.ReLU()),
        "conv_bn_eps_big_relu": lambda: S(conv(), nn.BatchNorm2d(4, eps=0.5), nn.ReLU()),
        "conv_bn_relu6": lambda: S(conv(), nn.BatchNorm2d(4), nn.ReLU6()),
        "conv_block_residual": ConvBlock,
        "bn_used_twice": BnUsedTwice,
    }


def _input_for(model: Any, g: Any, dtype: Any = None) -> Any:
    import torch

    first = next(m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)))
    if isinstance(first, torch.nn.Conv2d):
        return randn(g, 3, 4, 6, 6, dtype=dtype)
    return randn(g, 5, first.in_features, dtype=dtype)


def _randomize(model: Any, g: Any) -> Any:
    """Parameters and batch-norm statistics away from their initial values (never zero)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(randn(g, *p.shape, dtype=p.dtype) * 0.5)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(randn(g, *m.running_mean.shape) * 0.3)
                m.running_var.copy_(rand_pos(g, *m.running_var.shape))
    return model


def _run_model(model: Any, x: Any, train: bool, steps: int = 1) -> list:
    """Outputs, input gradient and parameter gradients of ``steps`` forward/backward passes (batch
    statistics move in training), then the state_dict's values in order."""
    import torch

    model.train(train)
    outs = []
    for _ in range(steps):
        xi = x.detach().clone().requires_grad_(True)
        for p in model.parameters():
            p.grad = None
        y = model(xi)
        w = torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).reshape(y.shape)
        (y * w).sum().backward()
        outs += [y.detach(), xi.grad] + [p.grad for p in model.parameters()]
    return outs + [v for v in model.state_dict().values()] + [list(model.state_dict().keys()), [n for n, _ in model.named_parameters()]]


def _same_lists(got: list, want: list, atol: float = 2e-5, rtol: float = 1e-4) -> Optional[str]:
    names_got, names_want = got[-2:], want[-2:]
    if names_got != names_want:
        return f"state_dict keys or named_parameters differ: {names_got} vs {names_want}"
    return differs(got[:-2], want[:-2], atol, rtol)


def _tool(name: str) -> Callable[[Any], Any]:
    import hal

    return {"fuse": lambda m: hal.nn.fuse(m), "patch": lambda m: hal.nn.patch(m)}[name]


def _nn_structure(struct: str, tool: str, train: bool) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import copy

        g = gen(f"nn/{struct}")
        model = _randomize(_structures()[struct](), g)
        x = _input_for(model, g)
        plain = copy.deepcopy(model)
        want, ref_exc = _capture(lambda: _run_model(plain, x, train, steps=2))
        got, exc = _capture(lambda: _run_model(_tool(tool)(model), x, train, steps=2))
        if exc is not None:
            return judge_exception(exc, ref_exc)
        if ref_exc is not None:
            return "silent", f"ran where the model as given raises {type(ref_exc).__name__}: {ref_exc}"
        why = _same_lists(got, want)
        return ("silent", why) if why else ("correct", "")

    return run


def _nn_feature(feature: str, tool: str) -> Callable[[], tuple[str, str]]:
    """A feature of the model a user may rely on, kept by the tool or refused clearly."""
    def run() -> tuple[str, str]:
        import copy

        import torch
        from torch import nn
        from torch.nn.utils import parametrizations, parametrize

        g = gen(f"feature/{feature}")
        conv = feature.startswith("conv_")
        model = _randomize(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()) if conv else
                           nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3), nn.ReLU()), g)
        x = _input_for(model, g)
        seen: list = []
        kind = feature.removeprefix("conv_")
        train = True

        def prepare(m: Any, stage: str) -> Any:
            """stage: "plain" (the reference: everything registered), "before" or "after" the tool."""
            after = stage == "after"
            target = m.get_submodule("0")
            if stage == "both" and not kind.endswith(("_norm", "_param")):
                return m
            if kind.startswith("hook_") and (stage == "plain" or kind.endswith("_after") == after):
                if "pre" in kind:
                    target.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
                elif "backward" in kind:
                    target.register_full_backward_hook(lambda mod, gi, go: seen.append(float(go[0].abs().sum())))
                elif "kwargs" in kind:
                    target.register_forward_hook(lambda mod, args, kwargs, out: out * 2.0, with_kwargs=True)
                else:
                    target.register_forward_hook(lambda mod, args, out: out * 2.0 + 0.1)
            if kind == "hook_on_bn" and not after:
                m[1].register_forward_hook(lambda mod, args, out: out - 0.2)
            if kind == "hook_on_act" and not after:
                m[-1].register_forward_hook(lambda mod, args, out: out + 0.3)
            if kind == "spectral_norm" and stage == "both":
                parametrizations.spectral_norm(m[0])
            if kind == "weight_norm" and stage == "both":
                parametrizations.weight_norm(m[0])
            if kind == "orthogonal_param" and stage == "both" and not conv:
                parametrizations.orthogonal(m[0])
            if kind == "custom_param" and stage == "both":
                class Doubled(nn.Module):
                    def forward(self, w: Any) -> Any:
                        return w * 2
                parametrize.register_parametrization(m[0], "weight", Doubled())
            if kind == "frozen_weight" and not after:
                m[0].weight.requires_grad_(False)
            if kind == "eval_mode" and not after:
                pass
            if kind == "replace_param" and after:
                target = m.get_submodule("0")
                target.weight = nn.Parameter(torch.full_like(target.weight, 0.25))
            if kind == "load_state_after" and after:
                m.load_state_dict({k: v * 0.5 if v.is_floating_point() else v for k, v in m.state_dict().items()})
            if kind == "to_double" and after:
                m.double()
            return m

        prepare(model, "both")  # parametrizations draw random vectors: registered once, then copied
        plain = prepare(copy.deepcopy(model), "plain")
        mine = prepare(copy.deepcopy(model), "before")
        if kind == "eval_mode":
            train = False
        if kind == "replace_param":
            plain[0].weight = nn.Parameter(torch.full_like(plain[0].weight, 0.25))
        if kind == "load_state_after":
            plain.load_state_dict({k: v * 0.5 if v.is_floating_point() else v for k, v in plain.state_dict().items()})
        if kind == "to_double":
            plain.double()
            x = x.double()
        got, exc = _capture(lambda: prepare(_tool(tool)(mine), "after"))
        if exc is not None:
            return judge_exception(exc)
        if kind == "deepcopy":
            got = copy.deepcopy(got)
        if kind == "pickle":
            buffer = io.BytesIO()
            try:
                torch.save(got, buffer)
                buffer.seek(0)
                got = torch.load(buffer, weights_only=False)
            except Exception as exc:  # noqa: BLE001
                return judge_exception(exc)
        ran_mine, exc = _capture(lambda: _run_model(got, x, train))
        if exc is not None:
            return judge_exception(exc)
        seen_mine = list(seen)
        seen.clear()
        want = _run_model(plain, x, train)
        why = _same_lists(ran_mine, want)
        if why:
            return "silent", why
        if seen_mine != seen and (len(seen_mine) != len(seen) or differs(seen_mine, seen, 1e-4, 1e-4)):
            return "silent", f"backward hooks saw {seen_mine}, on the model as given {seen}"
        if kind == "optimizer_state_order":
            opt = torch.optim.Adam(got.parameters())
            return "correct", ""
        return "correct", ""

    return run


def _hf_model(family: str, seed_salt: str, **over: Any) -> Any:
    import torch
    from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    families = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 8}),
        "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    }
    config_cls, model_cls, extra = families[family]
    torch.manual_seed(_seeded(SEED[0], f"hf/{family}/{seed_salt}"))
    model = model_cls(config_cls(**{**common, **extra, **over}))
    g = gen(f"hf-norms/{family}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(randn(g, *p.shape) * 0.3 + (0.0 if family == "gemma" else 1.0))
    return model.eval()


HF_FAMILIES = ("llama", "mistral", "qwen2", "gemma", "mixtral")
HF_FEATURES = ("loss_and_grads", "logits_padded", "attentions_config", "attentions_kwarg", "hidden_states", "packed_positions",
               "generate_greedy", "inputs_embeds", "logits_to_keep", "labels_all_ignored", "bfloat16_logits", "cache_continuation",
               "dict_output_false", "position_ids_offset", "batch_one_token", "layer_hook_calls", "eager_attention", "float64",
               "gradient_checkpointing", "resize_embeddings", "left_padded_generate", "proj_hook", "mlp_child_hook")


def _hf_attack(family: str, feature: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import copy

        import torch

        import hal

        over: dict = {}
        if feature == "attentions_config":
            over["output_attentions"] = True
        model = _hf_model(family, feature, **over)
        if feature == "bfloat16_logits":
            model = model.to(torch.bfloat16)
        if feature == "float64":
            model = model.double()
        if feature == "eager_attention":
            model.config._attn_implementation = "eager"
        if feature == "gradient_checkpointing":
            model.gradient_checkpointing_enable()
        plain = copy.deepcopy(model)
        hook_calls: dict = {}
        for m in (model, plain):
            hook_calls[id(m)] = []
            if feature == "layer_hook_calls":
                m.model.layers[0].register_forward_hook(lambda mod, a, o, calls=hook_calls[id(m)]: calls.append(1))
            if feature == "proj_hook":
                m.model.layers[1].self_attn.q_proj.register_forward_hook(lambda mod, a, o: o * 1.5)
            if feature == "mlp_child_hook":
                mlp = m.model.layers[0].mlp
                child = getattr(mlp, "down_proj", None) or getattr(mlp, "experts", None) or next(iter(mlp.children()))
                child.register_forward_hook(lambda mod, a, o: (o[0] * 0.5,) + tuple(o[1:]) if isinstance(o, tuple) else o * 0.5)
        g = gen(f"hf-batch/{family}/{feature}")
        ids = torch.randint(1, 96, (2, 10), generator=g)
        atol, rtol = (3e-2, 3e-2) if feature == "bfloat16_logits" else (2e-5, 2e-4)

        def call(m: Any) -> Any:
            if feature == "loss_and_grads":
                labels = ids.clone()
                labels[0, :3] = -100
                m.train()
                out = m(input_ids=ids, labels=labels)
                out.loss.backward()
                return [out.loss.detach()] + [p.grad for p in m.parameters()]
            if feature == "logits_padded":
                mask = torch.ones_like(ids)
                mask[1, :4] = 0
                return m(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            if feature in ("attentions_config", "attentions_kwarg"):
                out = m(input_ids=ids, **({"output_attentions": True} if feature == "attentions_kwarg" else {}))
                return [out.logits] + list(out.attentions or ())
            if feature == "hidden_states":
                out = m(input_ids=ids, output_hidden_states=True)
                return [out.logits] + list(out.hidden_states)
            if feature == "packed_positions":
                pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * 2)
                return m(input_ids=ids, position_ids=pos).logits
            if feature == "generate_greedy":
                return m.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
            if feature == "inputs_embeds":
                emb = m.get_input_embeddings()(ids).detach() * 1.1
                return m(inputs_embeds=emb).logits
            if feature == "logits_to_keep":
                return m(input_ids=ids, logits_to_keep=3).logits
            if feature == "labels_all_ignored":
                return m(input_ids=ids, labels=torch.full_like(ids, -100)).loss
            if feature == "bfloat16_logits":
                return m(input_ids=ids).logits.float()
            if feature == "cache_continuation":
                first = m(input_ids=ids[:, :6], use_cache=True)
                return m(input_ids=ids[:, 6:], past_key_values=first.past_key_values, use_cache=True).logits
            if feature == "dict_output_false":
                out = m(input_ids=ids, return_dict=False)
                return out[0]
            if feature == "position_ids_offset":
                pos = torch.arange(5, 15).expand(2, 10)
                return m(input_ids=ids, position_ids=pos).logits
            if feature == "batch_one_token":
                return m(input_ids=ids[:1, :1]).logits
            if feature == "layer_hook_calls":
                return [m(input_ids=ids).logits, torch.tensor(float(len(hook_calls[id(m)])))]
            if feature in ("eager_attention", "float64", "proj_hook", "mlp_child_hook"):
                return m(input_ids=ids).logits
            if feature == "gradient_checkpointing":
                m.train()
                out = m(input_ids=ids, labels=ids)
                out.loss.backward()
                return [out.loss.detach()] + [p.grad for p in m.parameters()]
            if feature == "resize_embeddings":
                m.resize_token_embeddings(100)
                return m(input_ids=ids, labels=ids).loss
            if feature == "left_padded_generate":
                mask = torch.ones_like(ids[:, :6])
                mask[0, :2] = 0
                return m.generate(ids[:, :6], attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
            raise AssertionError(feature)

        want, ref_exc = _capture(lambda: call(plain))
        patched, exc = _capture(lambda: hal.nn.patch(model))
        if exc is not None:
            return judge_exception(exc)
        got, exc = _capture(lambda: call(patched))
        if exc is not None:
            return judge_exception(exc, ref_exc)
        if ref_exc is not None:
            return "silent", f"ran where the unpatched model raises {type(ref_exc).__name__}: {ref_exc}"
        why = differs(got, want, atol, rtol)
        return ("silent", why) if why else ("correct", "")

    return run


@builder("nn")
def _nn_attacks() -> list[Attack]:
    out = []
    for struct in _structures():
        for tool in ("fuse", "patch"):
            for train in (True, False):
                out.append(Attack("nn", f"{tool}/{struct}/{'train' if train else 'eval'}", _nn_structure(struct, tool, train),
                                  quick=struct in ("lin_leaky", "conv_reflect_bn_relu", "conv_block_residual") and train))
    features = ("hook_forward_before", "hook_forward_after", "hook_pre_before", "hook_pre_after", "hook_backward_before",
                "hook_backward_after", "hook_kwargs_before", "hook_on_bn", "hook_on_act", "spectral_norm", "weight_norm",
                "orthogonal_param", "custom_param", "frozen_weight", "eval_mode", "replace_param", "load_state_after", "to_double",
                "deepcopy", "pickle")
    for feature in features:
        for conv in (False, True):
            for tool in ("fuse", "patch"):
                name = ("conv_" if conv else "") + feature
                out.append(Attack("nn", f"{tool}/feature/{name}", _nn_feature(name, tool),
                                  quick=feature in ("hook_forward_after", "spectral_norm") and not conv))
    for family in HF_FAMILIES:
        for feature in HF_FEATURES:
            out.append(Attack("nn", f"hf/{family}/{feature}", _hf_attack(family, feature), timeout_s=180,
                              quick=family == "llama" and feature in ("packed_positions", "attentions_config")))
    return out


# ----------------------------------------------------------------------------------------------------
# optimize: hal.optimize's step against the plain loop it replaces
# ----------------------------------------------------------------------------------------------------


def _optimize_case(model_kind: str, opt_kind: str, variant: str) -> Callable[[], tuple[str, str]]:
    """Three steps of ``hal.optimize(model, optimizer)`` against three steps of the plain loop
    (forward, loss, backward, optimizer.step, zero_grad) on a copy: losses and parameters."""
    def run() -> tuple[str, str]:
        import copy

        import torch
        import torch.nn.functional as F
        from torch import nn

        import hal

        g = gen(f"optimize/{model_kind}/{opt_kind}/{variant}")
        torch.manual_seed(_seeded(SEED[0], "optimize-init"))
        if model_kind == "mlp":
            model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
            xs = [randn(g, 6, 8) for _ in range(3)]
        elif model_kind == "conv":
            # no conv bias before a training batch norm: its gradient is zero, so Adam would step on rounding noise
            model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 25, 4))
            xs = [randn(g, 2, 3, 5, 5) for _ in range(3)]
        elif model_kind == "norms":
            model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.SiLU(), nn.Linear(8, 8), nn.RMSNorm(8), nn.Linear(8, 4))
            xs = [randn(g, 6, 8) for _ in range(3)]
        else:  # frozen: a frozen first layer
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            model[0].requires_grad_(False)
            xs = [randn(g, 6, 8) for _ in range(3)]
        _randomize(model, g)
        ys = [randn(g, xs[0].shape[0], 4) for _ in range(3)]
        plain = copy.deepcopy(model)

        def make_opt(m: Any) -> Any:
            params = [p for p in m.parameters() if p.requires_grad]
            return {"adamw": lambda: torch.optim.AdamW(params, lr=0.01, weight_decay=0.05),
                    "adam": lambda: torch.optim.Adam(params, lr=0.01),
                    "adamw_amsgrad": lambda: torch.optim.AdamW(params, lr=0.01, amsgrad=True),
                    "adamw_maximize": lambda: torch.optim.AdamW(params, lr=0.01, maximize=True),
                    "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                    "adamw_groups": lambda: torch.optim.AdamW([{"params": params[:1], "lr": 0.02}, {"params": params[1:]}], lr=0.01),
                    "hal_adamw": lambda: hal.optim.AdamW(params, lr=0.01)}[opt_kind]()

        loss_fn = F.mse_loss
        opt, ref_opt = make_opt(model), make_opt(plain)
        options: dict = dict(loss_fn=loss_fn, compile=False, graph=False, measure_steps=1)
        if variant == "rewrite_fuse":
            options["rewrite"] = "fuse"
        elif variant == "rewrite_patch":
            options["rewrite"] = "patch"
        elif variant == "no_replace":
            options["replace_optimizer"] = False
        elif variant == "candidates_hal":
            options["candidates"] = ["hal eager"]
        elif variant == "eval_mode":
            model.eval()
            plain.eval()

        def mine() -> Any:
            step = hal.optimize(model, opt, **options)
            losses = []
            for x, y in zip(xs, ys):
                losses.append(step(x, y).detach())
            return losses + [p.detach() for p in model.parameters()] + [b for b in model.buffers()]

        def ref() -> Any:
            losses = []
            for x, y in zip(xs, ys):
                loss = loss_fn(plain(x), y)
                loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
                losses.append(loss.detach())
            return losses + [p.detach() for p in plain.parameters()] + [b for b in plain.buffers()]

        got, exc = _capture(mine)
        want = ref()
        if exc is not None:
            return judge_exception(exc)
        return _trajectories(got, want)

    return run


def _trajectories(got: list, want: list) -> tuple[str, str]:
    """Three losses and the parameters after three Adam-like steps: the losses to float rounding;
    the parameters too, except a few elements whose gradient is near zero, where a rounding flips
    the sign of Adam's normalised update (up to 2 lr per step; at most 5% of the elements)."""
    import torch

    why = differs(got[:3], want[:3], 1e-5, 1e-3)
    if why:
        return "silent", "losses: " + why
    for i, (g, w) in enumerate(zip(got[3:], want[3:])):
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return "silent", f"parameter {i}: {differs(g, w, 0, 0)}"
        off = (g.double() - w.double()).abs() > 1e-4 + 1e-4 * w.double().abs()
        if int(off.sum()) > max(1, 0.05 * off.numel()) or float((g.double() - w.double()).abs().max()) > 0.12:
            return "silent", f"parameter {i}: {int(off.sum())} of {off.numel()} elements differ, up to {float((g - w).abs().max()):.3g}"
    return "correct", ""


def _optimize_misuse(name: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import torch
        import torch.nn.functional as F
        from torch import nn

        import hal

        g = gen("optimize-misuse/" + name)
        model = nn.Sequential(nn.Linear(4, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        x, y = randn(g, 5, 4), randn(g, 5, 3)
        fast = dict(compile=False, graph=False, measure_steps=1)

        class Raises(nn.Module):
            def forward(self, x: Any) -> Any:
                raise ValueError("the user's own model refuses this batch")

        cases: dict[str, Callable[[], Any]] = {
            "not_a_module": lambda: hal.optimize("model", opt, loss_fn=F.mse_loss, **fast)(x, y),
            "optimizer_of_other_model": lambda: hal.optimize(model, torch.optim.AdamW(nn.Linear(2, 2).parameters()), loss_fn=F.mse_loss,
                                                             **fast)(x, y),
            "loss_not_scalar": lambda: hal.optimize(model, opt, loss_fn=lambda o, t: (o - t) ** 2, **fast)(x, y),
            "no_loss_fn_logits": lambda: hal.optimize(model, opt, **fast)(x),
            "inputs_too_many": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, inputs=3, **fast)(x, y),
            "inputs_zero": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, inputs=0, **fast)(x, y),
            "rewrite_unknown": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, rewrite="everything", **fast)(x, y),
            "candidates_unknown": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, candidates=["hal warp"], **fast)(x, y),
            "candidates_empty": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, candidates=[], **fast)(x, y),
            "amp_int": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, amp=torch.int8, **fast)(x, y),
            "amp_string": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, amp="bfloat16", **fast)(x, y),
            "measure_steps_zero": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, compile=False, graph=False, measure_steps=0)(x, y),
            "wrong_target_shape": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, **fast)(x, randn(g, 5, 7)),
            "wrong_input_dtype": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, **fast)(x.double(), y),
            "users_valueerror": lambda: hal.optimize(Raises(), torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1),
                                                     loss_fn=F.mse_loss, **fast)(x, y),
            "model_on_meta": lambda: hal.optimize(nn.Linear(4, 3, device="meta"), None, loss_fn=F.mse_loss, **fast)(x, y),
            "explain_before_step": lambda: hal.optimize(model, opt, loss_fn=F.mse_loss, **fast).explain(),
        }
        own = {"users_valueerror": (ValueError,), "inputs_zero": (TypeError,)}.get(name, ())  # the model's own call
        if name == "optimizer_of_other_model":  # the plain loop does the same: the model is never trained
            before = [p.detach().clone() for p in model.parameters()]
            return holds(lambda: bool(cases[name]().isfinite()) and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                         or "the model changed")
        if name == "explain_before_step":
            return holds(lambda: isinstance(cases[name](), str) or "explain() did not return text")
        if name in ("wrong_target_shape", "wrong_input_dtype", "no_loss_fn_logits"):
            return compare(cases[name], lambda: F.mse_loss(model(x if name != "wrong_input_dtype" else x.double()),
                                                           y if name != "wrong_target_shape" else randn(g, 5, 7)), refused_ok=True)
        return refused(cases[name], own)

    return run


@builder("optimize")
def _optimize_attacks() -> list[Attack]:
    out = []
    for model_kind in ("mlp", "conv", "norms", "frozen"):
        for opt_kind in ("adamw", "adam", "adamw_amsgrad", "adamw_maximize", "sgd", "adamw_groups", "hal_adamw"):
            out.append(Attack("optimize", f"{model_kind}/{opt_kind}", _optimize_case(model_kind, opt_kind, "auto"), timeout_s=180,
                              quick=model_kind == "mlp" and opt_kind in ("adamw_maximize",)))
        for variant in ("rewrite_fuse", "rewrite_patch", "no_replace", "candidates_hal", "eval_mode"):
            out.append(Attack("optimize", f"{model_kind}/adamw/{variant}", _optimize_case(model_kind, "adamw", variant), timeout_s=180))
    for name in ("not_a_module", "optimizer_of_other_model", "loss_not_scalar", "no_loss_fn_logits", "inputs_too_many", "inputs_zero",
                 "rewrite_unknown", "candidates_unknown", "candidates_empty", "amp_int", "amp_string", "measure_steps_zero",
                 "wrong_target_shape", "wrong_input_dtype", "users_valueerror", "model_on_meta",
                 "explain_before_step"):
        out.append(Attack("optimize", f"misuse/{name}", _optimize_misuse(name), timeout_s=120, quick=name == "users_valueerror"))
    return out


# ----------------------------------------------------------------------------------------------------
# fp8: quantisation ops and the FP8 Linear on the CPU (the emulation)
# ----------------------------------------------------------------------------------------------------


def _fp8_case(name: str, edge: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import torch

        import hal
        import hal.fp8

        g = gen(f"fp8/{name}/{edge}")
        n = 0 if edge == "empty" else 8
        x = randn(g, n, 16)
        if edge == "nan":
            x[1, 3] = float("nan")
        elif edge == "inf":
            x[2, 5], x[3, 1] = float("inf"), float("-inf")
        elif edge == "noncontig":
            x = _noncontig(x)
        elif edge == "bfloat16":
            x = x.to(torch.bfloat16)
        elif edge == "int64":
            x = (x * 4).to(torch.int64)
        elif edge == "huge":
            x = x * 1e6
        fmt = {"e5m2": "e5m2"}.get(edge, "e4m3fn")
        torch_fmt = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]

        if name == "quantize_roundtrip":
            def mine() -> Any:
                q, scale = hal.ops.fp8_quantize(x, format=fmt)
                return hal.ops.fp8_dequantize(q, scale, format=fmt)

            def ref() -> Any:
                if not x.is_floating_point():
                    raise TypeError("not a float")
                xf = x.float()
                amax = xf.abs().amax() if xf.numel() else torch.tensor(0.0)
                finite_max = torch.finfo(torch_fmt).max
                amax = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones(()))
                scale = amax / finite_max
                return (xf / scale).clamp(-finite_max, finite_max).to(torch_fmt).float() * scale
            status, detail = compare(mine, ref, 1e-6, 0.13 if fmt == "e4m3fn" else 0.26, refused_ok=edge in ("int64",))
            if status == "silent" and edge in ("nan", "inf"):
                got, _ = _capture(mine)
                if got is not None and bool(torch.isnan(got).any()):  # non-finite amax: documented to give NaN
                    return "correct", "non-finite amax (documented)"
            return status, detail
        if name == "linear":
            lin = torch.nn.Linear(16, 12)
            _randomize(lin, g)
            if edge == "bfloat16":
                lin = lin.to(torch.bfloat16)
            fp8 = hal.fp8.Linear.from_linear(lin)

            def mine() -> Any:
                return fp8(x)

            def ref() -> Any:
                return lin(x)
            got, exc = _capture(mine)
            want, ref_exc = _capture(ref)
            if exc is not None:
                return judge_exception(exc, ref_exc)
            if ref_exc is not None:
                return "silent", f"ran where nn.Linear raises {type(ref_exc).__name__}"
            if got.shape != want.shape or got.dtype != want.dtype:
                return "silent", f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
            if got.numel() == 0:
                return "correct", ""
            fin = torch.isfinite(want)
            if not torch.equal(fin, torch.isfinite(got)) and edge not in ("nan", "inf"):
                return "silent", "non-finite where nn.Linear is finite"
            if edge in ("nan", "inf"):
                return ("correct", "") if bool((~torch.isfinite(got)).any()) else ("silent", "non-finite input gave a finite output")
            err = float((got.float() - want.float()).abs().max()) / max(1e-6, float(want.float().abs().max()))
            return ("correct", "") if err < 0.15 else ("silent", f"relative error {err:.3f} against nn.Linear")
        raise AssertionError(name)

    return run


def _fp8_misuse(name: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import torch

        import hal
        import hal.fp8
        from hal.fp8 import recipes

        g = gen("fp8-misuse/" + name)
        x = randn(g, 8, 16)
        cases = {
            "format_unknown": lambda: hal.ops.fp8_quantize(x, format="e3m4"),
            "granularity_unknown": lambda: hal.ops.fp8_quantize(x, granularity="columns"),
            "block_size_zero": lambda: hal.ops.fp8_quantize(x, granularity="block", block_size=0),
            "block_size_negative": lambda: hal.ops.fp8_quantize(x, granularity="block", block_size=-4),
            "scale_wrong_shape": lambda: hal.ops.fp8_quantize(x, scale=torch.ones(3)),
            "scale_negative": lambda: hal.ops.fp8_quantize(x, scale=torch.full((), -0.5)),
            "scale_zero": lambda: hal.ops.fp8_quantize(x, scale=torch.zeros(())),
            "dequantize_float_input": lambda: hal.ops.fp8_dequantize(x, torch.ones(())),
            "dequantize_out_dtype": lambda: hal.ops.fp8_dequantize(torch.zeros(8, 16, dtype=torch.uint8) + 3, torch.ones(()), out_dtype="int8"),
            "scaled_mm_inner_mismatch": lambda: hal.ops.fp8_scaled_mm(torch.full((4, 8), 60, dtype=torch.uint8),
                                                                      torch.full((6, 7), 60, dtype=torch.uint8), torch.ones(()), torch.ones(())),
            "scaled_mm_float_operands": lambda: hal.ops.fp8_scaled_mm(x, x.t(), torch.ones(()), torch.ones(())),
            "linear_recipe_wrong": lambda: hal.fp8.Linear(4, 4, recipe="delayed"),
            "convert_keep_unknown": lambda: hal.fp8.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)), keep=("nope",)),
            "recipe_format_unknown": lambda: recipes.CurrentScaling(format="e9m9"),
            "linear_wrong_in_features": lambda: hal.fp8.Linear(16, 4)(randn(g, 3, 5)),
            "delayed_history_zero": lambda: hal.fp8.Linear.from_linear(torch.nn.Linear(16, 4), recipes.DelayedScaling(history=0))(x),
            "delayed_margin_negative": lambda: hal.fp8.Linear.from_linear(torch.nn.Linear(16, 4), recipes.DelayedScaling(margin=-3))(x),
            "delayed_amax_compute_unknown": lambda: recipes.DelayedScaling(amax_compute="median"),
        }
        if name == "linear_wrong_in_features":
            return compare(cases[name], lambda: torch.nn.Linear(16, 4)(randn(g, 3, 5)))
        return refused(cases[name])

    return run


@builder("fp8")
def _fp8_attacks() -> list[Attack]:
    out = []
    for name in ("quantize_roundtrip", "linear"):
        for edge in ("base", "nan", "inf", "empty", "noncontig", "bfloat16", "int64", "huge", "e5m2"):
            out.append(Attack("fp8", f"{name}[{edge}]", _fp8_case(name, edge), quick=edge == "nan"))
    for name in ("format_unknown", "granularity_unknown", "block_size_zero", "block_size_negative", "scale_wrong_shape",
                 "scale_negative", "scale_zero", "dequantize_float_input", "dequantize_out_dtype", "scaled_mm_inner_mismatch",
                 "scaled_mm_float_operands", "linear_recipe_wrong", "convert_keep_unknown", "recipe_format_unknown",
                 "linear_wrong_in_features", "delayed_history_zero", "delayed_margin_negative", "delayed_amax_compute_unknown"):
        out.append(Attack("fp8", f"misuse/{name}", _fp8_misuse(name), quick=name == "block_size_zero"))
    return out


# ----------------------------------------------------------------------------------------------------
# library: ops declared and kernels registered by the user
# ----------------------------------------------------------------------------------------------------

_NAMES = [0]


def _fresh(prefix: str) -> str:
    _NAMES[0] += 1
    return f"a41_{prefix}_{_NAMES[0]}"


def _declare_cube(name: str, backward: Optional[str] = None, fake: bool = True, dtypes: tuple = ("float32", "float64")) -> Any:
    import hal
    from hal.types import Tensor

    def cube(x: Tensor, factor: float = 2.0) -> Tensor:
        """factor * x**3"""

    cube.__name__ = cube.__qualname__ = name
    cube.__annotations__ = {"x": Tensor, "factor": float, "return": Tensor}  # this file's annotations are strings
    options = {"backward": backward, "gradients": "x"} if backward else {}
    op = hal.library.declare(dtypes=dtypes, tolerances=hal.library.ELEMENTWISE, **options)(cube)
    if fake:
        @op.fake
        def _(a: dict) -> Any:
            return a["x"].new_empty(a["x"].shape)
    return op


def _library_kernel(kind: str) -> Callable[[], tuple[str, str]]:
    """A kernel returning something other than its op's result: caught at the call, never given."""
    def run() -> tuple[str, str]:
        import numpy as np
        import torch

        import hal

        name = _fresh("k")
        op = _declare_cube(name)
        api = "numpy" if kind.startswith("np_") else None
        bodies: dict[str, Callable[..., Any]] = {
            "good": lambda x, factor: factor * x**3,
            "wrong_shape": lambda x, factor: (factor * x**3)[:-1],
            "wrong_dtype": lambda x, factor: (factor * x**3).double() if x.dtype == torch.float32 else (factor * x**3).float(),
            "none": lambda x, factor: None,
            "ndarray": lambda x, factor: (factor * x**3).numpy(),
            "list": lambda x, factor: [factor * x**3],
            "tuple2": lambda x, factor: (factor * x**3, x),
            "scalar": lambda x, factor: 3.0,
            "int_tensor": lambda x, factor: (factor * x**3).long(),
            "view_of_input": lambda x, factor: x,
            "raises_keyerror": lambda x, factor: {}["missing"],
            "raises_valueerror": lambda x, factor: (_ for _ in ()).throw(ValueError("kernel refuses")),
            "np_good": lambda x, factor: factor * np.asarray(x) ** 3,
            "np_tensor": lambda x, factor: torch.from_numpy(factor * np.asarray(x) ** 3),
            "np_wrong_dtype": lambda x, factor: (factor * np.asarray(x) ** 3).astype(np.float16),
            "np_scalar": lambda x, factor: np.float32(1.0),
            "second_call_wrong": None,
        }
        calls = [0]

        def second_wrong(x: Any, factor: float) -> Any:
            calls[0] += 1
            return factor * x**3 if calls[0] == 1 else (factor * x**3)[:1]

        body = bodies[kind] if kind != "second_call_wrong" else second_wrong
        hal.library.register_kernel(name, backend="cpu", name="mine", priority=100, array_api=api)(body)
        g = gen("lib/" + kind)
        x = randn(g, 4, 5)
        want = 2.0 * x**3
        own = (KeyError,) if kind == "raises_keyerror" else (ValueError,) if kind == "raises_valueerror" else ()
        if kind in ("good", "np_good", "view_of_input"):
            return compare(lambda: op(x), lambda: want if kind != "view_of_input" else x)
        if kind == "second_call_wrong":
            op(x)
            with hal.library.checking_results():
                return refused(lambda: op(randn(g, 4, 5)), own)
        return refused(lambda: op(x), own)

    return run


def _library_registration(kind: str) -> Callable[[], tuple[str, str]]:
    """Declarations and registrations that cannot work: refused when made (or, for a backward op
    declared later, when the op is first needed), never a raw error or a wrong result."""
    def run() -> tuple[str, str]:
        import torch

        import hal
        from hal.types import Tensor

        name = _fresh("r")
        g = gen("libreg/" + kind)
        x = randn(g, 3, 4)

        def nobody() -> None:
            pass

        if kind == "backward_never_declared":
            def attempt() -> Any:
                op = _declare_cube(name, backward="no_such_backward")
                hal.library.register_kernel(name, backend="cpu", name="k", priority=50)(lambda x, factor: factor * x**3)
                return op(x.requires_grad_(True)).sum().backward()
            return refused(attempt)
        if kind == "backward_is_forward_op":
            return refused(lambda: _declare_cube(name, backward="softmax"))
        cases: dict[str, Callable[[], Any]] = {
            "dtype_unknown": lambda: _declare_cube(name, dtypes=("float7",)),
            "dtypes_string": lambda: _declare_cube(name, dtypes="float32"),
            "dtypes_empty": lambda: _declare_cube(name, dtypes=()),
            "name_of_hal_op": lambda: _declare_cube("softmax"),
            "kernel_unknown_op": lambda: hal.library.register_kernel(name, backend="cpu", name="k")(lambda x: x),
            "kernel_unknown_backend": lambda: (_declare_cube(name), hal.library.register_kernel(name, backend="tpu", name="k")(
                lambda x, factor: x)),
            "kernel_wrong_params": lambda: (_declare_cube(name), hal.library.register_kernel(name, backend="cpu", name="k")(
                lambda y: y)),
            "kernel_dtype_undeclared": lambda: (_declare_cube(name), hal.library.register_kernel(name, backend="cpu", name="k",
                                                                                               dtypes=("int8",))(lambda x, factor: x)),
            "kernel_name_twice": lambda: (_declare_cube(name), hal.library.register_kernel(name, backend="cpu", name="k")(lambda x, factor: x),
                                          hal.library.register_kernel(name, backend="cpu", name="k")(lambda x, factor: x)),
            "kernel_priority_float": lambda: hal.library.register_kernel("softmax", backend="cpu", name=name, priority=1.5),
            "kernel_contexts_unknown": lambda: hal.library.register_kernel("softmax", backend="cpu", name=name, contexts={"warp": 3}),
            "kernel_contexts_priority_str": lambda: hal.library.register_kernel("softmax", backend="cpu", name=name,
                                                                               contexts={"eager": "high"}),
            "kernel_array_api_jax": lambda: hal.library.register_kernel("softmax", backend="cpu", name=name, array_api="jax")(
                lambda x, dim: x),
            "kernel_check_not_callable": lambda: hal.library.register_kernel("softmax", backend="cpu", name=name, check="yes"),
            "kernel_differentiable_str": lambda: hal.library.register_kernel("softmax", backend="cpu", name=name, differentiable="y"),
            "backend_twice": lambda: hal.library.define_backend("cpu", priority=1, device_types=("cpu",)),
            "backend_device_types_str": lambda: hal.library.define_backend(name, priority=1, device_types="cpu"),
            "backend_probe_not_callable": lambda: hal.library.define_backend(name, priority=1, device_types=("cpu",), probe="ok"),
            "backend_priority_str": lambda: hal.library.define_backend(name, priority="1", device_types=("cpu",)),
            "param_untyped": lambda: hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)(
                type(nobody)(compile(f"def {name}(x): pass", "<a41>", "exec").co_consts[0], {})),
            "param_list_annotation": lambda: hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)(
                _annotated(name, list)),
            "tolerances_missing": lambda: hal.library.declare(dtypes=("float32",))(_annotated(name, Tensor)),
            "tolerances_wrong_type": lambda: hal.library.declare(dtypes=("float32",), tolerances=1e-5)(_annotated(name, Tensor)),
            "option_unknown": lambda: hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE, speed="fast")(
                _annotated(name, Tensor)),
        }
        return refused(cases[kind])

    return run


def _annotated(name: str, annotation: Any) -> Callable[..., Any]:
    def fn(x):  # type: ignore[no-untyped-def]
        """an op"""
    fn.__annotations__ = {"x": annotation, "return": annotation}
    fn.__name__ = fn.__qualname__ = name
    return fn


def _library_working(kind: str) -> Callable[[], tuple[str, str]]:
    """What a correct registration gives: autograd through a backward op declared after its
    forward, a backend of the process, NumPy callers, torch.compile."""
    def run() -> tuple[str, str]:
        import torch

        import hal
        from hal.types import Tensor

        name = _fresh("w")
        g = gen("libwork/" + kind)
        x = randn(g, 3, 4)
        if kind == "backward_declared_after":
            op = _declare_cube(name, backward=name + "_backward")

            def cube_backward(grad_out: Tensor, x: Tensor, factor: float = 2.0) -> Tensor:
                """grad"""
            cube_backward.__name__ = cube_backward.__qualname__ = name + "_backward"
            cube_backward.__annotations__ = {"grad_out": Tensor, "x": Tensor, "factor": float, "return": Tensor}
            bw = hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE, forward=name)(cube_backward)
            bw.fake(lambda a: a["x"].new_empty(a["x"].shape))
            hal.library.register_kernel(name, backend="cpu", name="k", priority=50)(lambda x, factor: factor * x**3)
            hal.library.register_kernel(name + "_backward", backend="cpu", name="k", priority=50)(lambda grad_out, x, factor: grad_out * 3 * factor * x * x)

            def grad(fn: Callable[[Any], Any]) -> Any:
                xi = x.clone().requires_grad_(True)
                fn(xi).sum().backward()
                return xi.grad
            return compare(lambda: grad(op), lambda: grad(lambda t: 2.0 * t**3))
        op = _declare_cube(name)
        if kind == "numpy_caller":
            hal.library.register_kernel(name, backend="cpu", name="k", priority=50)(lambda x, factor: factor * x**3)
            return compare(lambda: op(x.numpy()), lambda: (2.0 * x**3).numpy())
        if kind == "own_backend":
            bname = _fresh("be")
            hal.library.define_backend(bname, priority=1000, device_types=("cpu",))
            hal.library.register_kernel(name, backend=bname, name="k")(lambda x, factor: factor * x**3)
            return compare(lambda: op(x, 3.0), lambda: 3.0 * x**3)
        if kind == "own_backend_probe_says_no":
            bname = _fresh("be")
            hal.library.define_backend(bname, priority=1000, device_types=("cpu",), probe=lambda: "the device is asleep")
            hal.library.register_kernel(name, backend=bname, name="k")(lambda x, factor: factor * x**3 + 1)
            hal.library.register_kernel(name, backend="cpu", name="k2")(lambda x, factor: factor * x**3)
            return compare(lambda: op(x), lambda: 2.0 * x**3)
        if kind == "own_backend_probe_raises":
            bname = _fresh("be")
            hal.library.define_backend(bname, priority=1000, device_types=("cpu",), probe=lambda: {}["boom"])
            hal.library.register_kernel(name, backend="cpu", name="k2")(lambda x, factor: factor * x**3)
            return compare(lambda: op(x), lambda: 2.0 * x**3, refused_ok=True)
        if kind == "compiled":
            hal.library.register_kernel(name, backend="cpu", name="k", priority=50)(lambda x, factor: factor * x**3)
            return compare(lambda: torch.compile(lambda t: op(t) + 1, fullgraph=True, backend="eager")(x), lambda: 2.0 * x**3 + 1)
        if kind == "check_raises":
            def check(inputs: Any) -> Any:
                raise KeyError("inside the user's check")
            hal.library.register_kernel(name, backend="cpu", name="k", priority=50, check=check)(lambda x, factor: factor * x**3)
            return compare(lambda: op(x), lambda: 2.0 * x**3, refused_ok=True, own=(KeyError,))
        if kind == "check_returns_str":
            hal.library.register_kernel(name, backend="cpu", name="k", priority=50, check=lambda inputs: "no")(lambda x, factor: factor * x**3)
            return compare(lambda: op(x), lambda: 2.0 * x**3, refused_ok=True)
        if kind == "explain":
            hal.library.register_kernel(name, backend="cpu", name="k", priority=50)(lambda x, factor: factor * x**3)
            return holds(lambda: "k" in str(hal.explain(name, x)) or "explain does not list the kernel")
        raise AssertionError(kind)

    return run


@builder("library")
def _library_attacks() -> list[Attack]:
    out = []
    for kind in ("good", "wrong_shape", "wrong_dtype", "none", "ndarray", "list", "tuple2", "scalar", "int_tensor", "view_of_input",
                 "raises_keyerror", "raises_valueerror", "np_good", "np_tensor", "np_wrong_dtype", "np_scalar", "second_call_wrong"):
        out.append(Attack("library", f"kernel/{kind}", _library_kernel(kind), quick=kind in ("wrong_shape", "ndarray")))
    for kind in ("backward_never_declared", "backward_is_forward_op", "dtype_unknown", "dtypes_string", "dtypes_empty", "name_of_hal_op",
                 "kernel_unknown_op", "kernel_unknown_backend", "kernel_wrong_params", "kernel_dtype_undeclared", "kernel_name_twice",
                 "kernel_priority_float", "kernel_contexts_unknown", "kernel_contexts_priority_str", "kernel_array_api_jax",
                 "kernel_check_not_callable", "kernel_differentiable_str", "backend_twice", "backend_device_types_str",
                 "backend_probe_not_callable", "backend_priority_str", "param_untyped", "param_list_annotation", "tolerances_missing",
                 "tolerances_wrong_type", "option_unknown"):
        out.append(Attack("library", f"registration/{kind}", _library_registration(kind),
                          quick=kind in ("backward_never_declared", "dtype_unknown")))
    for kind in ("backward_declared_after", "numpy_caller", "own_backend", "own_backend_probe_says_no", "own_backend_probe_raises",
                 "compiled", "check_raises", "check_returns_str", "explain"):
        out.append(Attack("library", f"working/{kind}", _library_working(kind), quick=kind == "backward_declared_after"))
    return out


# ----------------------------------------------------------------------------------------------------
# cli: python -m hal ... with bad arguments and paths
# ----------------------------------------------------------------------------------------------------


def _cli(args: list, expect_ok: bool = False, timeout: float = 120) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        tmp = tempfile.mkdtemp(prefix="a41cli-")
        try:
            argv = [a.replace("{tmp}", tmp) for a in args]
            Path(tmp, "afile").write_text("x")
            try:
                out = subprocess.run([sys.executable, "-m", "hal", *argv], capture_output=True, text=True, timeout=timeout, cwd=tmp,
                                     env=_worker_env())
            except subprocess.TimeoutExpired:
                raise Verdict("crash", f"hung past {timeout} s")
            text = out.stdout + out.stderr
            if out.returncode < 0:
                return "crash", f"killed by signal {-out.returncode}"
            if "Traceback (most recent call last)" in text:
                return "raw", f"exit {out.returncode}, traceback: " + text.strip().splitlines()[-1][:200]
            if expect_ok:
                return ("correct", "") if out.returncode == 0 else ("silent", f"exit {out.returncode}: {text[-200:]}")
            if out.returncode == 0:
                return "silent", "bad arguments, exit status 0: " + text[-200:]
            return "clear", f"exit {out.returncode}: " + (text.strip().splitlines() or [""])[-1][:200]
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return run


@builder("cli")
def _cli_attacks() -> list[Attack]:
    cases = {
        "info_bogus_flag": ["info", "--bogus"],
        "no_such_command": ["frobnicate"],
        "conformance_unknown_backend": ["conformance", "--backend", "nosuch", "--quick"],
        "conformance_unknown_op": ["conformance", "--ops", "nosuchop", "--quick"],
        "conformance_unknown_dtype": ["conformance", "--dtypes", "float7", "--quick"],
        "conformance_report_dir_under_file": ["conformance", "--quick", "--ops", "softmax", "--report-dir", "{tmp}/afile/sub"],
        "conformance_report_dir_proc": ["conformance", "--quick", "--ops", "softmax", "--report-dir", "/proc/a41"],
        "conformance_device_negative": ["conformance", "--device", "-1", "--quick", "--ops", "softmax"],
        "conformance_device_text": ["conformance", "--device", "x"],
        "conformance_model_unknown": ["conformance", "--model", "nosuchmodel"],
        "conformance_model_bad_callable": ["conformance", "--model", "os:getcwd"],
        "conformance_model_missing_module": ["conformance", "--model", "no_such_module:make"],
        "conformance_steps_zero": ["conformance", "--model", "cnn", "--steps", "0"],
        "conformance_reference_unknown": ["conformance", "--model", "cnn", "--reference", "nosuch"],
        "bench_unknown_op": ["bench", "--ops", "nosuchop"],
        "bench_unknown_backend": ["bench", "--backend", "nosuch", "--ops", "softmax"],
        "bench_unknown_model": ["bench", "--models", "nosuchmodel"],
        "tune_missing_module": ["tune", "no_such_module:make"],
        "tune_not_callable": ["tune", "os:sep"],
        "tune_getcwd": ["tune", "os:getcwd"],
        "tune_export_bad_path": ["tune", "os:getcwd", "--export", "{tmp}/afile/x.json"],
        "tune_no_colon": ["tune", "justaname"],
        "env_bad_backend": ["info"],
        "env_bad_tune": ["info"],
        "env_bad_strict": ["info"],
        "info_json": ["info", "--json"],
    }
    out = []
    for name, args in cases.items():
        out.append(Attack("cli", name, _cli_env(name, args), timeout_s=150,
                          quick=name in ("info_bogus_flag", "conformance_report_dir_under_file", "tune_getcwd")))
    return out


def _cli_env(name: str, args: list) -> Callable[[], tuple[str, str]]:
    env = {"env_bad_backend": ("HAL_BACKEND", "nosuch"), "env_bad_tune": ("HAL_TUNE", "sometimes"),
           "env_bad_strict": ("HAL_STRICT", "maybe")}.get(name)

    def run() -> tuple[str, str]:
        if env is None:
            return _cli(args, expect_ok=name == "info_json")()
        old = os.environ.get(env[0])
        os.environ[env[0]] = env[1]
        try:
            # hal bench reads HAL_* as every call does (hal conformance forces each kernel and its own settings)
            return _cli(["bench", "--ops", "softmax"])()
        finally:
            if old is None:
                os.environ.pop(env[0], None)
            else:
                os.environ[env[0]] = old
    return run


# ----------------------------------------------------------------------------------------------------
# tuning: the tune cache on disk (damaged records and files, other versions, concurrent writers),
# HAL_TUNE, seeds, hal.tune and TuneCache misused; judged against torch and docs (hal.tuning.cache)
# ----------------------------------------------------------------------------------------------------

_TUNE_ROUTES = ("a41tune/fast", "a41tune/slow")


def _tune_runtime() -> Any:
    """A CPU backend with two softmax kernels of known cost (the slow one sleeps): measured choice
    has something to measure on any machine."""
    import torch

    from hal import dispatch
    from hal.plugin import Plugin
    from hal.runtime import Runtime

    def kernel(seconds: float) -> Callable[..., Any]:
        def softmax(x: Any, dim: int) -> Any:
            if seconds:
                time.sleep(seconds)
            return torch.softmax(x, dim)
        return softmax

    p = Plugin("a41tune", "1.0")
    p.define_backend(priority=1000, device_types=("cpu",))
    p.kernel("softmax", name="slow", priority=100)(kernel(0.002))
    p.kernel("softmax", name="fast", priority=99)(kernel(0.0))
    dispatch.install(Runtime.from_plugins([p]))
    return p


@contextlib.contextmanager
def _tune_scope(mode: Optional[str] = "on", directory: Optional[str] = None) -> Iterator[tuple[Path, list]]:
    """HAL_TUNE=mode, HAL_TUNE_CACHE a fresh directory (or ``directory``), the timed runtime
    installed; yields the cache directory and the list the "hal" logger's warnings go to."""
    import logging

    from hal import dispatch

    tmp = tempfile.mkdtemp(prefix="a41tune-")
    saved = {k: os.environ.get(k) for k in ("HAL_TUNE", "HAL_TUNE_CACHE")}
    warned: list = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warned.append(record.getMessage())

    handler = Catch()
    logger = logging.getLogger("hal")
    logging.disable(logging.NOTSET)
    logger.addHandler(handler)
    previous = dispatch.DISPATCHER._runtime
    try:
        if mode is None:
            os.environ.pop("HAL_TUNE", None)
        else:
            os.environ["HAL_TUNE"] = mode
        os.environ["HAL_TUNE_CACHE"] = directory.replace("{tmp}", tmp) if directory else str(Path(tmp) / "tune")
        _tune_runtime()
        yield Path(os.environ["HAL_TUNE_CACHE"]), warned
    finally:
        logger.removeHandler(handler)
        logging.disable(logging.CRITICAL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        dispatch.install(previous)
        dispatch.reset()
        shutil.rmtree(tmp, ignore_errors=True)


def _softmax_call(g: Any) -> tuple[str, str]:
    """hal.ops.softmax through the timed runtime against torch.softmax (and explain runs)."""
    import torch

    import hal

    x = randn(g, 4, 8)
    status, detail = compare(lambda: hal.ops.softmax(x, 1), lambda: torch.softmax(x, 1))
    if status == "correct":
        d, exc = _capture(lambda: hal.explain("softmax", x, 1))
        if exc is not None:
            return judge_exception(exc)
        if d.kernel not in ("fast", "slow"):
            return "silent", f"explain names kernel {d.kernel!r}"
    return status, detail


def _cache_file_problem(directory: Path) -> Optional[str]:
    """Why the cache file(s) under ``directory`` would not load cleanly now (None if they do)."""
    from hal.tuning import cache as tc

    for path in directory.glob("*.json"):
        try:
            document = json.loads(path.read_text())
            _, dropped = tc._checked_entries(document, document.get("device"), document.get("versions"))
        except Exception as exc:  # noqa: BLE001
            return f"{path.name} still unusable after a measurement rewrote it: {type(exc).__name__}: {exc}"
        if dropped:
            return f"{path.name} still holds unusable records after a measurement rewrote it: {dropped[:2]}"
    return None


#: (name, damage to the parsed document or None, raw text replacing the file or None, warned): each
#: applied to a file the first call measured, then a fresh process-like cache reads it
def _tune_damages() -> list[tuple[str, Optional[Callable[[dict], Any]], Optional[bytes], bool]]:
    def field(name: str, value: Any, drop: bool = False) -> Callable[[dict], Any]:
        def damage(doc: dict) -> dict:
            for record in doc["entries"].values():
                if drop:
                    record.pop(name, None)
                else:
                    record[name] = value
            return doc
        return damage

    def top(name: str, value: Any, drop: bool = False) -> Callable[[dict], Any]:
        def damage(doc: dict) -> dict:
            if drop:
                doc.pop(name, None)
            else:
                doc[name] = value
            return doc
        return damage

    def records(value: Any) -> Callable[[dict], Any]:
        def damage(doc: dict) -> dict:
            doc["entries"] = {k: value for k in doc["entries"]}
            return doc
        return damage

    def times(value: Any) -> Callable[[dict], Any]:
        def damage(doc: dict) -> dict:
            for record in doc["entries"].values():
                record["times_us"] = {label: value for label in record["times_us"]}
            return doc
        return damage

    out: list = []
    for name, value in (("null", None), ("list", [3.0, 1.0]), ("string", "fast"), ("number", 5), ("empty", {})):
        out.append((f"times_us_{name}", field("times_us", value), None, name != "empty"))
    for name, value in (("string", "quick"), ("negative", -1.0), ("nan", float("nan")), ("bool", True), ("object", {"a": 1}),
                        ("null", None), ("infinity", float("inf")), ("inf_text", "inf"), ("huge", 1e300)):
        out.append((f"time_{name}", times(value), None, name not in ("inf_text", "huge", "infinity")))
    for name, value in (("null", None), ("number", 7), ("list", ["a41tune/fast"]), ("unknown_route", "nosuch/route"), ("empty", "")):
        out.append((f"winner_{name}", field("winner", value), None, name in ("null", "number", "list")))
    out.append(("winner_missing", field("winner", None, drop=True), None, True))
    out.append(("times_us_missing", field("times_us", None, drop=True), None, True))
    for f, value in (("context", 5), ("op", ["softmax"]), ("source", None), ("measured", 12)):
        out.append((f"{f}_wrong_type", field(f, value), None, True))
    out.append(("extra_field", field("note", {"any": "thing"}), None, False))
    for name, value in (("null", None), ("list", []), ("string", "x"), ("number", 3)):
        out.append((f"record_{name}", records(value), None, True))
    for name, value, drop in (("entries_list", [], False), ("entries_null", None, False), ("entries_missing", None, True),
                              ("format_2", 2, False), ("format_text", "1", False), ("format_missing", None, True),
                              ("device_other", "cpu-other-model-1t", False), ("device_null", None, False),
                              ("versions_other", {"hal": "0.0.1"}, False), ("versions_null", None, False), ("versions_list", [], False)):
        out.append((name, top(name.split("_")[0], value, drop), None, True))
    for name, raw in (("empty_file", b""), ("truncated", None), ("not_json", b"{ not json"), ("top_list", b"[]"),
                      ("top_null", b"null"), ("binary", bytes(range(256))), ("not_utf8", b'{"format": 1, "device": "\xff\xfe"}'),
                      ("nan_top", b"NaN"), ("deep", b"[" * 100000 + b"]" * 100000)):
        out.append((name, None, raw if raw is not None else b"TRUNCATE", True))
    return out


def _tune_damaged(name: str, damage: Optional[Callable[[dict], Any]], raw: Optional[bytes], warned_expected: bool,
                  mode: str = "on") -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        from hal import dispatch
        from hal.dispatch import measure

        with _tune_scope("on") as (directory, warned):
            g = gen("tuning/" + name)
            status, detail = _softmax_call(g)  # measures and writes the file
            if status != "correct":
                return status, "the first (measuring) call: " + detail
            [path] = list(directory.glob("*.json"))
            if raw == b"TRUNCATE":
                text = path.read_bytes()
                path.write_bytes(text[: len(text) // 2])
            elif raw is not None:
                path.write_bytes(raw)
            else:
                path.write_text(json.dumps(damage(json.loads(path.read_text()))))
            os.environ["HAL_TUNE"] = mode
            dispatch.reset()
            _tune_runtime()  # a new cache object: reads the damaged file, as a new process would
            warned.clear()
            before = len(measure.LOG)
            status, detail = _softmax_call(g)
            if status != "correct":
                return status, f"after the damage ({name}): {detail}"
            if warned_expected and not any(str(path) in w for w in warned):
                return "silent", f"a damaged cache ({name}) read without a warning naming the file"
            if not warned_expected and warned:
                return "silent", f"a usable cache ({name}) warned about: {warned[0][:200]}"
            if len(measure.LOG) > before:
                problem = _cache_file_problem(directory)
                if problem:
                    return "silent", problem
            return "correct", ("warned: " + warned[0][:120]) if warned else ""
    return run


def _tune_env(value: Optional[str], valid: bool) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        with _tune_scope(value) as (directory, warned):
            g = gen(f"tuning/env/{value}")
            if valid:
                status, detail = _softmax_call(g)
                if status != "correct":
                    return status, detail
                mode = (value or "on").strip().lower() or "on"
                wrote = list(directory.glob("*.json"))
                if mode == "on" and not wrote:
                    return "silent", f"HAL_TUNE={value!r} measured nothing / wrote no cache"
                if mode != "on" and wrote:
                    return "silent", f"HAL_TUNE={value!r} wrote a cache file"
                return "correct", ""
            import torch

            import hal
            x = randn(g, 4, 8)
            return refused(lambda: hal.ops.softmax(x, 1))
    return run


def _tune_dir(kind: str) -> Callable[[], tuple[str, str]]:
    """HAL_TUNE_CACHE unusable: the call still runs, one warning, the record kept in memory."""
    def run() -> tuple[str, str]:
        directory = {"under_file": "{tmp}/afile/tune", "proc": "/proc/a41tune", "is_file": "{tmp}/afile",
                     "tilde": "~/../../{tmp}/tilde"}.get(kind, "{tmp}/tune")
        with _tune_scope("on", directory) as (path, warned):
            tmp = str(path).split("/afile")[0] if "afile" in str(path) else None
            if tmp:
                Path(tmp).mkdir(parents=True, exist_ok=True)
                Path(tmp, "afile").write_text("x")
            else:
                Path(tempfile.gettempdir()).mkdir(exist_ok=True)
            if kind == "lock_is_dir":
                from hal.dispatch import measure
                from hal import dispatch
                import torch
                cache = measure.cache_for(torch.device("cpu"), dispatch.DISPATCHER.runtime())
                cache.path.parent.mkdir(parents=True, exist_ok=True)
                cache.path.with_name(cache.path.name + ".lock").mkdir()
            if kind == "file_is_dir":
                from hal.dispatch import measure
                from hal import dispatch
                import torch
                cache = measure.cache_for(torch.device("cpu"), dispatch.DISPATCHER.runtime())
                cache.path.mkdir(parents=True)
            g = gen("tuning/dir/" + kind)
            status, detail = _softmax_call(g)
            if status != "correct":
                return status, detail
            status, detail = _softmax_call(g)  # the second call: from memory, no second warning
            if status != "correct":
                return status, "second call: " + detail
            if kind not in ("tilde",) and not warned:
                return "silent", f"an unusable cache directory ({kind}) without a warning"
            if len(warned) > 1 and kind not in ("file_is_dir",):
                return "silent", f"{len(warned)} warnings for one problem: {warned[:2]}"
            return "correct", (warned[0][:150] if warned else "")
    return run


_WRITER = """
import sys, time
from pathlib import Path
from hal.tuning.cache import TuneCache
directory, worker, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = TuneCache("cpu-a41-model", {"hal": "x", "torch": "y"}, Path(directory))
while not Path(directory, "go").exists():
    time.sleep(0.005)
for i in range(count):
    cache.put(f"w{worker}-k{i}", {"winner": f"w{worker}", "times_us": {"a": float(i)}, "source": "measured"})
"""


def _tune_concurrent(kind: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        from hal.tuning import cache as tc

        tmp = Path(tempfile.mkdtemp(prefix="a41tune-conc-"))
        try:
            workers, count = (4, 25) if kind == "processes" else (6, 40)
            versions = {"hal": "x", "torch": "y"}
            bad_reads: list = []
            if kind == "processes":
                procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp), str(w), str(count)], env=_worker_env(),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for w in range(workers)]
                (tmp / "go").write_text("")
                path = tc.TuneCache("cpu-a41-model", versions, tmp).path
                while any(p.poll() is None for p in procs):
                    if path.exists():
                        try:
                            tc._checked_entries(json.loads(path.read_text()), "cpu-a41-model", versions)
                        except Exception as exc:  # noqa: BLE001
                            bad_reads.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.002)
                errors = [p.stderr.read() for p in procs if p.wait(timeout=120) != 0]
                if errors:
                    return "raw", "a writer failed: " + errors[0][-300:]
            else:
                caches = [tc.TuneCache("cpu-a41-model", versions, tmp) for _ in range(workers)]
                failures: list = []

                def put(w: int) -> None:
                    try:
                        for i in range(count):
                            caches[w].put(f"w{w}-k{i}", {"winner": f"w{w}", "times_us": {"a": float(i)}, "source": "measured"})
                    except Exception as exc:  # noqa: BLE001
                        failures.append(exc)
                threads = [threading.Thread(target=put, args=(w,)) for w in range(workers)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                if failures:
                    return judge_exception(failures[0])
            final = tc.TuneCache("cpu-a41-model", versions, tmp).entries()
            want = {f"w{w}-k{i}" for w in range(workers) for i in range(count)}
            missing = want - set(final)
            if missing:
                return "silent", f"{len(missing)} of {len(want)} records lost by concurrent writers (e.g. {sorted(missing)[:3]})"
            if bad_reads:
                return "silent", f"a reader saw an unusable file {len(bad_reads)} times: {bad_reads[0][:200]}"
            return "correct", ""
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return run


def _tune_api(name: str) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        import torch

        import hal
        from hal.tuning import TuneCache

        tmp = Path(tempfile.mkdtemp(prefix="a41tune-api-"))
        try:
            (tmp / "afile").write_text("x")
            good = {"winner": "a", "times_us": {"a": 1.0}}
            cache = TuneCache("cpu-a41-model", {"hal": "x"}, tmp)
            documented_type_errors = {  # put: "Raises TypeError if record is not a JSON-able dict whose fields hold what FIELDS says"
                "put_tensor_record": lambda: cache.put("k", {"winner": "a", "times_us": {"a": torch.tensor(1.0)}}),
                "put_times_text": lambda: cache.put("k", {"winner": "a", "times_us": {"a": "fast"}}),
                "put_winner_missing": lambda: cache.put("k", {"times_us": {"a": 1.0}}),
                "put_not_dict": lambda: cache.put("k", [1, 2]),
                "put_key_int": lambda: cache.put(3, good),
                "put_nan_time": lambda: cache.put("k", {"winner": "a", "times_us": {"a": float("nan")}}),
            }
            if name in documented_type_errors:
                got, exc = _capture(documented_type_errors[name])
                if exc is None:
                    return "silent", "bad record accepted"
                if isinstance(exc, TypeError) and "tuning" in str(exc):
                    return "clear", f"TypeError (documented): {exc}"
                return judge_exception(exc)
            if name == "export_under_file":  # documented: raises OSError
                got, exc = _capture(lambda: cache.export(tmp / "afile" / "seed.json"))
                if isinstance(exc, OSError):
                    return "clear", f"OSError (documented): {exc}"
                return ("silent", "export to a path under a file returned") if exc is None else judge_exception(exc)
            if name.startswith("device_"):
                device = {"device_slash": "../evil", "device_empty": "", "device_dot": ".hidden", "device_int": 5}[name]
                got, exc = _capture(lambda: TuneCache(device, {"hal": "x"}, tmp))
                if isinstance(exc, (ValueError, TypeError)) and "slug" in str(exc):
                    return "clear", f"{type(exc).__name__}: {exc}"
                return ("silent", f"device {device!r} accepted") if exc is None else judge_exception(exc)
            if name == "versions_not_mapping":
                return refused(lambda: TuneCache("cpu-a41-model", ["hal"], tmp))
            if name.startswith("seed_"):
                seed = tmp / "seed.json"
                doc = {"format": 1, "device": "cpu-a41-model", "versions": {"old": "1"}, "entries": {"k": good}}
                if name == "seed_garbage":
                    seed.write_bytes(b"\x00\x01garbage")
                elif name == "seed_other_device":
                    seed.write_text(json.dumps({**doc, "device": "cpu-other"}))
                elif name == "seed_bad_record":
                    seed.write_text(json.dumps({**doc, "entries": {"k": {"winner": 3, "times_us": None}, "j": good}}))
                elif name == "seed_good_old_versions":
                    seed.write_text(json.dumps(doc))
                elif name == "seed_is_dir":
                    seed.mkdir()
                with _tune_scope("on") as (_, warned):
                    c, exc = _capture(lambda: TuneCache("cpu-a41-model", {"hal": "x"}, tmp / "c", seeds=[seed, tmp / "missing.json"]))
                    if exc is not None:
                        return judge_exception(exc)
                    entries = c.entries()
                if name == "seed_good_old_versions":
                    return ("correct", "") if entries.get("k", {}).get("source") == "seed" else ("silent", f"seed not served: {entries}")
                if name == "seed_bad_record":
                    if "k" in entries or entries.get("j", {}).get("source") != "seed":
                        return "silent", f"bad seed record served or good one lost: {entries}"
                elif entries:
                    return "silent", f"an unusable seed served records: {entries}"
                return ("correct", warned[0][:150]) if warned else ("silent", f"unusable seed ({name}) without a warning")
            if name == "tune_not_callable":
                return refused(lambda: hal.tune(5))
            if name == "tune_step_raises":
                def step() -> None:
                    raise ValueError("the user's own error")
                with _tune_scope("off"):
                    got, exc = _capture(lambda: hal.tune(step))
                if isinstance(exc, ValueError) and str(exc) == "the user's own error":
                    return "clear", "the user's own exception passed through"
                return ("silent", "a raising step reported success") if exc is None else judge_exception(exc)
            if name == "tune_step_ok":
                with _tune_scope("off") as (directory, _):
                    x = randn(gen("tuning/tune"), 4, 8)
                    report = hal.tune(lambda: hal.ops.softmax(x, 1))
                    if not torch.allclose(report.result, torch.softmax(x, 1)):
                        return "silent", "hal.tune's result differs from torch.softmax"
                    if len(report.measurements) != 1 or report.measurements[0].winner not in _TUNE_ROUTES:
                        return "silent", f"hal.tune measured {report.rows()} (HAL_TUNE=off must not stop it)"
                    str(report)
                    return "correct", ""
            if name == "cached_mode_reads":
                with _tune_scope("on") as (directory, _):
                    g = gen("tuning/cached")
                    status, detail = _softmax_call(g)
                    from hal import dispatch
                    from hal.dispatch import measure
                    os.environ["HAL_TUNE"] = "cached"
                    dispatch.reset()
                    _tune_runtime()
                    before = len(measure.LOG)
                    status, detail = _softmax_call(g)
                    if status != "correct":
                        return status, detail
                    x = randn(g, 4, 8)
                    d = hal.explain("softmax", x, 1)
                    if len(measure.LOG) != before or d.measurement is None or d.measurement.source != "cache":
                        return "silent", f"HAL_TUNE=cached did not serve the cached record: {d}"
                    return "correct", ""
            raise AssertionError(name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return run


@builder("tuning")
def _tuning_attacks() -> list[Attack]:
    out = []
    for name, damage, raw, warned in _tune_damages():
        out.append(Attack("tuning", f"record/{name}", _tune_damaged(name, damage, raw, warned),
                          quick=name in ("times_us_null", "time_string", "truncated", "versions_other")))
    for name, damage, raw, warned in _tune_damages()[:3]:
        out.append(Attack("tuning", f"record_cached_mode/{name}", _tune_damaged(name, damage, raw, warned, mode="cached")))
    for value, valid in (("on", True), ("ON", True), (" cached ", True), ("off", True), ("Off", True), (None, True), ("", True),
                         ("sometimes", False), ("0", False), ("1", False), ("true", False), ("of f", False)):
        out.append(Attack("tuning", f"HAL_TUNE={value!r}", _tune_env(value, valid), quick=value == "sometimes"))
    for kind in ("under_file", "proc", "is_file", "lock_is_dir", "file_is_dir"):
        out.append(Attack("tuning", f"cache_dir/{kind}", _tune_dir(kind), quick=kind == "under_file"))
    for kind in ("processes", "threads"):
        out.append(Attack("tuning", f"concurrent/{kind}", _tune_concurrent(kind), timeout_s=150, quick=kind == "threads"))
    for name in ("put_tensor_record", "put_times_text", "put_winner_missing", "put_not_dict", "put_key_int", "put_nan_time",
                 "export_under_file", "device_slash", "device_empty", "device_dot", "device_int", "versions_not_mapping",
                 "seed_garbage", "seed_other_device", "seed_bad_record", "seed_good_old_versions", "seed_is_dir",
                 "tune_not_callable", "tune_step_raises", "tune_step_ok", "cached_mode_reads"):
        out.append(Attack("tuning", f"api/{name}", _tune_api(name)))
    return out


# ----------------------------------------------------------------------------------------------------
# parallel: hal.parallel on 2 real gloo ranks (one launch runs a batch of cases on both ranks, each
# rank judging its own outcome against torch in one process; a rank that dies or hangs loses only
# the case it was in, marked crash, and the batch goes on in a new launch after it)
# ----------------------------------------------------------------------------------------------------

PV = 11  # vocabulary of the parallel cases: 6 rows per rank, the last of rank 1's slice padding
_WORST = {s: i for i, s in enumerate(("correct", "clear", "silent", "raw", "crash"))}


def _parallel_cases(rank: Optional[int]) -> dict[str, Callable[[], tuple[str, str]]]:
    """name -> the case as ``rank`` runs it, each returning (status, detail) judged on that rank.
    Built in the same order on every rank (groups are made collectively); ``rank`` None: for the
    names only (no process group needed)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hal.parallel import (ColumnParallelLinear, ExpertParallelMoE, ParallelLayerNorm, ParallelRMSNorm, RowParallelLinear,
                              VocabParallelEmbedding, VocabParallelLMHead, comm, vocab_parallel_linear_cross_entropy)

    names_only = rank is None
    rank = rank or 0
    g = gen("parallel/setup")  # the same draws on every rank
    table = torch.nn.Embedding(PV, 5, dtype=torch.float64)
    head_full = torch.nn.Linear(5, PV, bias=False, dtype=torch.float64)
    col_full = torch.nn.Linear(8, 6, dtype=torch.float64)
    row_full = torch.nn.Linear(6, 8, dtype=torch.float64)
    with torch.no_grad():
        for p in [table.weight, head_full.weight, *col_full.parameters(), *row_full.parameters()]:
            p.copy_(randn(g, *p.shape, dtype=torch.float64))
    emb = head = head_none = col = row = only0 = None
    alone: dict = {0: None, 1: None}
    if not names_only:
        emb = VocabParallelEmbedding.from_embedding(table)
        head = VocabParallelLMHead.from_linear(head_full)
        head_none = VocabParallelLMHead.from_linear(head_full, reduction="none")
        col = ColumnParallelLinear.from_linear(col_full, gather_output=True)
        row = RowParallelLinear.from_linear(row_full, input_is_parallel=False)
        only0 = dist.new_group([0])
        alone = {r: dist.new_group([r]) for r in range(2)}
    ids = torch.randint(0, PV, (3, 4), generator=g)
    x5 = randn(g, 6, 5, dtype=torch.float64)
    x8 = randn(g, 3, 8, dtype=torch.float64)
    x6 = randn(g, 3, 6, dtype=torch.float64)
    target = torch.randint(0, PV, (6,), generator=g)

    def on(t: Any, value: Any, where: tuple = (0, 0), ranks: tuple = (0, 1)) -> Any:
        out = t.clone()
        if rank in ranks:
            out[where] = value
        return out

    def both(hal_fn: Callable[[], Any], ref_fn: Callable[[], Any], **kw: Any) -> Callable[[], tuple[str, str]]:
        return lambda: compare(hal_fn, ref_fn, **kw)

    def bad(fn: Callable[[], Any]) -> Callable[[], tuple[str, str]]:
        return lambda: refused(fn)

    def outside(make: Callable[[Any], Any]) -> Callable[[], tuple[str, str]]:
        """Rank 1 is not in the group: refused there; rank 0 builds the layer."""
        if rank == 1:
            return lambda: refused(lambda: make(only0))
        return lambda: holds(lambda: make(only0) is not None)

    cases: dict[str, Callable[[], tuple[str, str]]] = {}
    # ids: nn.Embedding's behaviour (IndexError out of range) on the same ids
    for name, value, ranks in (("past_vocab", PV + 3, (0, 1)), ("negative", -1, (0, 1)), ("padding_row", PV, (0, 1)),
                               ("huge", 2**40, (0, 1)), ("very_negative", -(2**40), (0, 1)), ("rank1_only", PV, (1,)),
                               ("rank0_only_negative", -2, (0,)), ("last", PV - 1, (0, 1)), ("first", 0, (0, 1))):
        t = on(ids, value, (1, 2), ranks)
        t_ref = on(ids, value, (1, 2), (0, 1))  # what torch sees: the bad id wherever any rank holds it
        if ranks == (0, 1):
            cases[f"ids/{name}"] = both(lambda t=t: emb(t), lambda t=t: table(t), atol=1e-12, rtol=1e-12)
        else:
            cases[f"ids/{name}"] = bad(lambda t=t: emb(t))
    for dt in ("int32", "int16", "uint8", "bool", "float32"):
        t = ids.to(getattr(torch, dt)) if dt != "bool" else ids > 4
        cases[f"ids_dtype/{dt}"] = both(lambda t=t: emb(t), lambda t=t: table(t), atol=1e-12, rtol=1e-12, refused_ok=True)
    cases["ids/alone_in_group"] = bad(lambda: VocabParallelEmbedding(PV, 3, alone[rank])(on(ids, PV + rank)))
    cases["ids/empty"] = both(lambda: emb(ids[:, :0]), lambda: table(ids[:, :0]))
    cases["ids/scalar"] = both(lambda: emb(ids[0, 0]), lambda: table(ids[0, 0]), atol=1e-12, rtol=1e-12)
    cases["ids/noncontig"] = both(lambda: emb(ids.t()), lambda: table(ids.t()), atol=1e-12, rtol=1e-12)
    # targets of the vocab-parallel LM head + loss: F.cross_entropy's behaviour
    for name, value, ranks in (("past_vocab", PV + 7, (0, 1)), ("padding_row", PV, (0, 1)), ("negative", -5, (0, 1)),
                               ("ignored", -100, (0, 1)), ("huge", 2**40, (0, 1)), ("rank0_only", PV, (0,)),
                               ("rank1_only_negative", -3, (1,)), ("last", PV - 1, (0, 1))):
        t = on(target, value, (2,), ranks)
        if ranks == (0, 1):
            cases[f"target/{name}"] = both(lambda t=t: head(x5, t), lambda t=t: F.cross_entropy(head_full(x5), t), atol=1e-10, rtol=1e-9)
            cases[f"target_none/{name}"] = both(lambda t=t: head_none(x5, t),
                                               lambda t=t: F.cross_entropy(head_full(x5), t, reduction="none"), atol=1e-10, rtol=1e-9)
            cases[f"target_fn/{name}"] = both(
                lambda t=t: vocab_parallel_linear_cross_entropy(x5, head.weight, t, vocab_size=PV),
                lambda t=t: F.cross_entropy(head_full(x5), t), atol=1e-10, rtol=1e-9)
        else:
            cases[f"target/{name}"] = bad(lambda t=t: head(x5, t))
    cases["target/all_ignored"] = both(lambda: head(x5, torch.full((6,), -100)), lambda: F.cross_entropy(head_full(x5), torch.full((6,), -100)))
    cases["target/float"] = both(lambda: head(x5, target.double()), lambda: F.cross_entropy(head_full(x5), target.double()), refused_ok=True)
    cases["target/rows_mismatch"] = both(lambda: head(x5, target[:4]), lambda: F.cross_entropy(head_full(x5), target[:4]))
    cases["target/2d"] = both(lambda: head(x5, target[None]), lambda: F.cross_entropy(head_full(x5), target[None]), refused_ok=True)
    cases["target/label_smoothing"] = both(lambda: vocab_parallel_linear_cross_entropy(x5, head.weight, target, vocab_size=PV, label_smoothing=0.2),
                                           lambda: F.cross_entropy(head_full(x5), target, label_smoothing=0.2), atol=1e-10, rtol=1e-9)
    cases["target/label_smoothing_bad"] = both(lambda: vocab_parallel_linear_cross_entropy(x5, head.weight, target, vocab_size=PV, label_smoothing=1.5),
                                               lambda: F.cross_entropy(head_full(x5), target, label_smoothing=1.5), atol=1e-10, rtol=1e-9)
    cases["target/reduction_bad"] = bad(lambda: vocab_parallel_linear_cross_entropy(x5, head.weight, target, vocab_size=PV, reduction="avg"))
    cases["target/vocab_size_wrong"] = bad(lambda: vocab_parallel_linear_cross_entropy(x5, head.weight, target, vocab_size=PV + 5))
    # a group without the calling rank
    cases["group/column"] = outside(lambda grp: ColumnParallelLinear(4, 8, mesh=grp))
    cases["group/row"] = outside(lambda grp: RowParallelLinear(4, 8, mesh=grp))
    cases["group/embedding"] = outside(lambda grp: VocabParallelEmbedding(PV, 4, grp))
    cases["group/head"] = outside(lambda grp: VocabParallelLMHead(4, PV, grp))
    cases["group/rmsnorm"] = outside(lambda grp: ParallelRMSNorm(8, mesh=grp))
    cases["group/moe"] = outside(lambda grp: ExpertParallelMoE(4, 6, 2, 1, group=grp))
    cases["group/gather"] = (lambda: refused(lambda: comm.gather_from_parallel(x8, 0, only0))) if rank == 1 else \
        (lambda: compare(lambda: comm.gather_from_parallel(x8, 0, only0), lambda: x8))
    # shapes, dtypes, values differing across ranks: the same clear error on every rank
    for name, fn in (
        ("column_rows", lambda: col(x8[: 2 + rank])),
        ("column_dtype", lambda: col(x8.float() if rank else x8)),
        ("column_width", lambda: ColumnParallelLinear(8 + rank, 6)(torch.randn(2, 8 + rank))),
        ("row_rows", lambda: row(x6[: 2 + rank])),
        ("row_dtype", lambda: RowParallelLinear(8, 6, dtype=torch.float64 if rank else torch.float32)(
            torch.randn(3, 4, dtype=torch.float64 if rank else torch.float32))),
        ("embedding_ids_shape", lambda: emb(ids[: 2 + rank])),
        ("embedding_ids_values", lambda: emb(on(ids, (int(ids[0, 0]) + 1) % PV, ranks=(1,)))),
        ("embedding_ids_dtype", lambda: emb(ids.int() if rank else ids)),
        ("head_rows", lambda: head(x5[: 5 + rank], target[: 5 + rank])),
        ("head_targets", lambda: head(x5, on(target, (int(target[0]) + 1) % PV, (0,), (1,)))),
        ("head_x_dtype", lambda: head(x5.float() if rank else x5, target)),
        ("loss_settings", lambda: vocab_parallel_linear_cross_entropy(x5, head.weight, target, vocab_size=PV, ignore_index=-100 - rank)),
        ("gather_shape", lambda: comm.gather_from_parallel(torch.ones(2, 3 + rank), 0)),
        ("gather_dtype", lambda: comm.gather_from_parallel(torch.ones(2, 3, dtype=torch.float64 if rank else torch.float32), 0)),
        ("gather_dim", lambda: comm.gather_from_parallel(torch.ones(2, 3), rank)),
        ("reduce_shape", lambda: comm.reduce_from_parallel(torch.ones(4 + rank))),
        ("reduce_dtype", lambda: comm.reduce_from_parallel(torch.ones(4, dtype=torch.float64 if rank else torch.float32))),
        ("scatter_shape", lambda: comm.scatter_to_parallel(torch.ones(4, 2 + 2 * rank), -1)),
        ("reduce_scatter_shape", lambda: comm.reduce_scatter_to_parallel(torch.ones(4 + 2 * rank, 2), 0)),
        ("copy_shape", lambda: comm.copy_to_parallel(torch.ones(3 + rank, requires_grad=True)).sum().backward()),
        ("norm_width_backward", lambda: ParallelRMSNorm(8 + 2 * rank)(torch.randn(2, 8 + 2 * rank, requires_grad=True)).sum().backward()),
        ("layernorm_bias_backward", lambda: ParallelLayerNorm(8, bias=rank == 0)(torch.randn(2, 8, requires_grad=True)).sum().backward()),
        ("moe_dtype", lambda: ExpertParallelMoE(4, 6, 2, 1, group=dist.group.WORLD, dtype=torch.float64 if rank else None)(
            torch.randn(5, 4, dtype=torch.float64 if rank else torch.float32))),
        ("moe_width", lambda: ExpertParallelMoE(4 + rank, 6, 2, 1, group=dist.group.WORLD)(torch.randn(5, 4 + rank))),
    ):
        cases[f"mismatch/{name}"] = bad(fn)
    # valid input: one process's torch result
    cases["valid/column_gathered"] = both(lambda: col(x8), lambda: col_full(x8), atol=1e-12, rtol=1e-10)
    cases["valid/column_noncontig"] = both(lambda: col(x8.t().contiguous().t()), lambda: col_full(x8), atol=1e-12, rtol=1e-10)
    cases["valid/row"] = both(lambda: row(x6), lambda: row_full(x6), atol=1e-12, rtol=1e-10)
    cases["valid/column_nan"] = both(lambda: col(on(x8, float("nan"), (1, 2))), lambda: col_full(on(x8, float("nan"), (1, 2))))
    cases["valid/row_inf"] = both(lambda: row(on(x6, float("inf"), (0, 1))), lambda: row_full(on(x6, float("inf"), (0, 1))))
    cases["valid/head_logits_gathered"] = both(lambda: head(x5, gather=True), lambda: head_full(x5), atol=1e-12, rtol=1e-10)
    cases["valid/head_loss_nan_x"] = both(lambda: head_none(on(x5, float("nan"), (3, 1)), target),
                                          lambda: F.cross_entropy(head_full(on(x5, float("nan"), (3, 1))), target, reduction="none"))
    cases["valid/reduce"] = both(lambda: comm.reduce_from_parallel(x8), lambda: 2 * x8)
    cases["valid/gather"] = both(lambda: comm.gather_from_parallel(x8 + rank, 0), lambda: torch.cat([x8, x8 + 1], 0))
    cases["valid/scatter"] = both(lambda: comm.scatter_to_parallel(x6, -1), lambda: x6.chunk(2, -1)[rank])
    cases["valid/empty_reduce"] = both(lambda: comm.reduce_from_parallel(x8[:0]), lambda: x8[:0])
    cases["valid/loss_grad"] = both(lambda: _loss_grads(lambda x: head(x, target), x5), lambda: _loss_grads(lambda x: F.cross_entropy(head_full(x), target), x5),
                                    atol=1e-10, rtol=1e-9)
    cases["valid/after_errors"] = both(lambda: row(F.gelu(col_full(x8))[:, :6] * 0 + x6), lambda: row_full(x6), atol=1e-12, rtol=1e-10)
    return cases


def _loss_grads(fn: Callable[[Any], Any], x: Any) -> Any:
    x = x.detach().clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


def _parallel_rank(rank: int, n: int, seed: int, names: list, folder: str) -> int:
    """Run the named cases in order, writing each start and outcome to ``folder/rank<r>.jsonl``."""
    import hal.dist as hd

    SEED[0] = seed
    warnings.simplefilter("ignore")
    hd.set_timeout(15.0)
    cases = _parallel_cases(rank)
    with open(Path(folder) / f"rank{rank}.jsonl", "a", buffering=1) as out:
        for name in names:
            out.write(json.dumps({"start": name}) + "\n")
            try:
                status, detail = cases[name]()
            except Verdict as v:
                status, detail = v.status, v.detail
            except Exception as exc:  # noqa: BLE001
                status, detail = judge_exception(exc)
            out.write(json.dumps({"name": name, "status": status, "detail": str(detail)[:600]}) + "\n")
            out.flush()
    return len(names)


#: the outcomes of the batch launched by the first parallel attack of a worker: name -> record
_PARALLEL_DONE: dict[str, dict] = {}


def _parallel_launch(names: list[str]) -> None:
    """Launch 2 gloo ranks on ``names``; where a rank dies or hangs, the case it was in is a crash
    and a new launch takes the rest."""
    from hal.dist import launch as hl

    if "hal.parallel" not in hl.PRELOAD:
        hl.PRELOAD.append("hal.parallel")
    todo = list(names)
    while todo:
        folder = tempfile.mkdtemp(prefix="a41par-")
        try:
            results = hl.launch("benchmarks.attacks41:_parallel_rank", 2, (SEED[0], todo, folder),
                                timeout_s=90 + len(todo), pg_timeout_s=30, env={"HAL_TUNE": "off"}, final_barrier=True)
            per_rank: list[dict] = []
            started: list[Optional[str]] = []
            for r in range(2):
                done, last = {}, None
                path = Path(folder) / f"rank{r}.jsonl"
                for line in (path.read_text().splitlines() if path.exists() else []):
                    rec = json.loads(line)
                    if "start" in rec:
                        last = rec["start"]
                    else:
                        done[rec["name"]] = rec
                        last = None
                per_rank.append(done)
                started.append(last)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        lost = None
        for name in todo:
            recs = [per_rank[r].get(name) for r in range(2)]
            if all(recs):
                worst = max((rec["status"] for rec in recs), key=_WORST.__getitem__)
                detail = "; ".join(f"rank {r}: {rec['status']} {rec['detail'][:250]}" for r, rec in enumerate(recs))
                _PARALLEL_DONE[name] = {"status": worst, "detail": detail}
                continue
            how = "; ".join(f"rank {res.rank}: {res.message[:200]}" for res in results if not res.ok) or "a rank did not report"
            _PARALLEL_DONE[name] = {"status": "crash", "detail": f"a rank died or hung in this case ({how})"}
            lost = name
            break
        todo = todo[todo.index(lost) + 1:] if lost is not None else []


def _parallel_attack(name: str, names: list[str]) -> Callable[[], tuple[str, str]]:
    def run() -> tuple[str, str]:
        if name not in _PARALLEL_DONE:
            batch = [n for n in names if n in _PARALLEL_QUICK] if QUICK[0] else names
            _parallel_launch(batch[batch.index(name):])
        rec = _PARALLEL_DONE[name]
        return rec["status"], rec["detail"]
    return run


_PARALLEL_QUICK = ("ids/past_vocab", "ids/rank1_only", "target/past_vocab", "target/rank0_only", "group/column", "mismatch/column_rows",
                   "mismatch/gather_shape", "mismatch/reduce_dtype", "valid/column_gathered", "valid/after_errors")
#: set by --quick in the worker: the parallel batch is then the quick cases only (one launch)
QUICK = [False]


@builder("parallel")
def _parallel_attacks() -> list[Attack]:
    names = list(_parallel_cases(None))
    return [Attack("parallel", name, _parallel_attack(name, names), quick=name in _PARALLEL_QUICK, timeout_s=600) for name in names]


if __name__ == "__main__":
    sys.exit(main())
