"""Step 2: arrays between the caller's type and device and the kernel's.

A kernel states the array type it takes (NumPy or torch, its backend's by default); a call may come
with the other one, or with device tensors for a CPU backend (a host fallback). These wrappers give
the kernel what it takes and the caller what it gave: zero-copy views between NumPy and torch CPU
tensors, copies through the host for device tensors, and arrays an in-place op wrote copied back
into the caller's. They also produce results of the right shape from an op's fake rule, for
``hal.explain`` following a decomposition without running it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from hal import arrays
from hal.errors import UnsupportedError
from hal.plugin import Inputs
from hal.registry import OpDecl
from hal.types import ARRAY_KINDS


#: what an array parameter may hold that is no array: an absent optional array, a number
_NOT_ARRAYS = frozenset((type(None), float, int, bool))


def array_slots(decl: OpDecl) -> tuple[int, ...]:
    """The positions of ``decl``'s array parameters (arrays, optional arrays, lists of arrays,
    numbers-or-arrays): the only arguments a conversion looks at."""
    return tuple(i for i, p in enumerate(decl.params) if p.kind in ARRAY_KINDS)


def map_arrays(decl: OpDecl, args: Sequence[Any], fn: Callable[[Any], Any], slots: Sequence[int] | None = None) -> list[Any]:
    """Apply ``fn`` to every array among ``args`` (inside lists too); ``slots``: the positions of
    the array parameters, :func:`array_slots` of ``decl``, computed once by a runner."""
    out = list(args)
    for i in array_slots(decl) if slots is None else slots:
        a = out[i]
        t = type(a)
        if t is np.ndarray or t is torch.Tensor:  # the common cases first: identity tests and one set lookup
            out[i] = fn(a)
        elif t in _NOT_ARRAYS:
            continue
        elif isinstance(a, (list, tuple)):
            out[i] = [fn(x) if arrays.is_array(x) else x for x in a]
        elif arrays.is_array(a):
            out[i] = fn(a)
    return out


def map_outputs(out: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every array of a result (tuples and lists too)."""
    t = type(out)
    if t is torch.Tensor or t is np.ndarray:  # one array, the common result: no isinstance chain
        return fn(out)
    if isinstance(out, (tuple, list)):
        return type(out)(map_outputs(o, fn) for o in out)
    if isinstance(out, (np.ndarray, np.generic, torch.Tensor)):
        return fn(out)
    return out


def kernel_runner(decl: OpDecl, fn: Callable[..., Any], kernel_api: str, input_api: str, host_of: Any = None,
                  args: Optional[Sequence[Any]] = None) -> Callable[..., Any]:
    """A kernel as the call runs it: ``fn`` given the array type it takes (``kernel_api``) for
    arrays of ``input_api``; with ``host_of`` (a device), a CPU kernel run on that device's tensors
    through host copies. ``args``: the canonical arguments of the call being decided, where the
    runner serves only calls of their cache key (a plan): NumPy arrays for a torch kernel are then
    converted by a runner made for their slots (:func:`_numpy_into_torch`), and so are torch tensors for a
    NumPy kernel (:func:`_torch_into_numpy`)."""
    if host_of is not None:
        return _via_host(decl, _array_api(decl, fn, kernel_api, "torch"), host_of)
    if args is not None and kernel_api != input_api:
        into = _numpy_into_torch if kernel_api == "torch" else _torch_into_numpy
        run = into(decl, fn, args)
        if run is not None:
            return run
    return _array_api(decl, fn, kernel_api, input_api)


def inputs_as(inputs: Inputs, api: str, views: dict[str, Inputs]) -> Inputs:
    """``inputs`` with arrays of the kernel's array type, so capability checks see what the kernel
    will receive (zero-copy views; made once per array type)."""
    if api == inputs.array_type:
        return inputs
    if api not in views:
        convert = arrays.to_numpy if api == "numpy" else arrays.from_numpy
        args = tuple(map_arrays(inputs.op, inputs.args, convert))
        views[api] = Inputs(inputs.op, args, inputs.device_kind, inputs.device, inputs.dtype, api, inputs.arch, inputs.for_graph)
    return views[api]


def fake_results(decl: OpDecl, args: Sequence[Any], array_type: str) -> Any:
    """Results of the right shape, dtype and device from the op's fake rule, nothing computed."""
    if decl.fake is None:
        raise UnsupportedError(f"{decl.name} declares no fake rule: hal.explain cannot follow a decomposition through it")
    named = decl.bind(map_arrays(decl, args, _as_torch) if array_type == "numpy" else args)
    out = decl.fake(named)
    return map_outputs(out, lambda t: t.numpy()) if array_type == "numpy" else out


def _array_api(decl: OpDecl, fn: Callable[..., Any], kernel_api: str, input_api: str) -> Callable[..., Any]:
    """Wrap a kernel so it receives the array type it takes and returns the caller's type."""
    if kernel_api == input_api:
        if kernel_api == "numpy":

            def run_numpy(*args: Any) -> Any:
                out = fn(*args)
                return out if type(out) is np.ndarray else map_outputs(out, _as_0d)

            return run_numpy
        return fn
    slots = array_slots(decl)
    if kernel_api == "numpy":  # torch CPU tensors into a NumPy kernel: zero-copy views

        def run(*args: Any) -> Any:
            conv = map_arrays(decl, args, arrays.to_numpy, slots)
            out = fn(*conv)
            if decl.mutates:
                _copy_back(decl, args, conv, _torch_into)
            return map_outputs(out, arrays.from_numpy)

        return run

    def run_torch(*args: Any) -> Any:  # NumPy arrays into a torch kernel
        conv = map_arrays(decl, args, arrays.from_numpy, slots)
        out = fn(*conv)
        if decl.mutates:
            _copy_back(decl, args, conv, _numpy_into)
        return map_outputs(out, arrays.to_numpy)

    return run_torch


def _numpy_into_torch(decl: OpDecl, fn: Callable[..., Any], args: Sequence[Any]) -> Optional[Callable[..., Any]]:
    """A torch kernel run on NumPy arrays, for calls of the cache key of ``args`` (None: the general
    runner of :func:`_array_api` serves them).

    A plan serves the calls of one key, and the key fixes which array parameters hold a NumPy
    array (its dtype, shape and strides too) and which hold None or a number: so the slots to
    convert, and whether a plain ``torch.from_numpy`` view serves them (not bfloat16, native byte
    order, no negative strides), are known once here, and a call converts exactly those slots with no per-argument
    type tests and no helper frames. Only whether an array is writeable is not in the key (a
    read-only array is copied, as :func:`hal.arrays.from_numpy` does). An op that writes its
    arguments, lists of arrays and array subclasses take the general runner. The result is viewed
    by ``Tensor.numpy`` (:func:`hal.arrays.to_numpy` where torch refuses that: bfloat16, a tensor
    requiring grad or with a conjugate or negative bit).

    Why: on the project's 2-core VM the general runner's Python (the slot loop, the helpers'
    frames, dtype and flag tests) cost about 0.7 us a call beside the conversions' own 1.2 us
    (``scale_shift_act`` on a (4, 4) array through the torch kernel, 2026-12-07); this runner's
    is under 0.1 us (``softmax``: 1.00 us over the tensor call, where ``torch.from_numpy`` and
    ``Tensor.numpy`` around ``torch.softmax`` cost 0.95 us without hal)."""
    if decl.mutates:
        return None
    at = []
    for i in array_slots(decl):
        a = args[i]
        t = type(a)
        if t is np.ndarray:
            if a.dtype == arrays.BFLOAT16 or not a.dtype.isnative or any(s < 0 for s in a.strides):
                return None
            at.append(i)
        elif t not in _NOT_ARRAYS:
            return None  # lists of arrays, subclasses: the general runner
    view, to_numpy, tensor = torch.from_numpy, arrays.to_numpy, torch.Tensor
    if not at:
        return None
    if at == [0]:

        def run_first(x: Any, *rest: Any) -> Any:  # the common case, the array first: no list built, no loop
            out = fn(view(x) if x.flags.writeable else view(x.copy()), *rest)
            if type(out) is tensor:
                try:
                    return out.numpy()
                except (RuntimeError, TypeError):
                    return to_numpy(out)
            return map_outputs(out, to_numpy)

        return run_first
    slots = tuple(at)

    def run(*args: Any) -> Any:
        a = list(args)
        for i in slots:
            x = a[i]
            a[i] = view(x) if x.flags.writeable else view(x.copy())
        out = fn(*a)
        if type(out) is tensor:
            try:
                return out.numpy()
            except (RuntimeError, TypeError):
                return to_numpy(out)
        return map_outputs(out, to_numpy)

    return run


def _torch_into_numpy(decl: OpDecl, fn: Callable[..., Any], args: Sequence[Any]) -> Optional[Callable[..., Any]]:
    """A NumPy kernel run on torch CPU tensors, for calls of the cache key of ``args`` (None: the
    general runner of :func:`_array_api` serves them).

    As in :func:`_numpy_into_torch`, the key fixes which array parameters hold a plain tensor or
    parameter (and its dtype) and which hold None or a number, so a call converts exactly those
    slots, each with ``Tensor.numpy`` (:func:`hal.arrays.to_numpy` where torch refuses that: at once
    for bfloat16; after a refused try for a tensor requiring grad in grad mode or one with a
    conjugate or negative bit, which the key does not name), and its results come back by
    :func:`hal.arrays.from_numpy`, a tuple of arrays without :func:`map_outputs`' recursion. An op
    that writes its arguments, lists of tensors and tensor subclasses take the general runner.

    Why: the CPU backend's numba kernels take NumPy arrays, and inside hal's autograd node (grad
    off) the general runner's Python (the slot loop, a helper frame per array, the results' walk)
    cost about 1.3 us of an RMS-norm forward and 2.3 us of its backward beside their conversions
    (on the project's 2-core VM at (2, 16, 64), 2026-12-07: 5.2 and 8.8 us through it against 2.4
    and 4.0 us for the kernels on NumPy arrays)."""
    if decl.mutates:
        return None
    at = []
    for i in array_slots(decl):
        t = type(args[i])
        if t is torch.Tensor or t is torch.nn.Parameter:
            at.append(i)
        elif t not in _NOT_ARRAYS:
            return None  # lists of tensors, subclasses: the general runner
    if not at:
        return None
    viewed = tuple(i for i in at if args[i].dtype != torch.bfloat16)
    bfloat16 = tuple(i for i in at if i not in viewed)  # Tensor.numpy refuses them: to_numpy's view at once
    to_numpy, ndarray = arrays.to_numpy, np.ndarray

    def run(*args: Any) -> Any:
        a = list(args)
        for i in viewed:
            x = a[i]
            try:  # the common case in one call, as to_numpy's first try (without its frame)
                a[i] = x.numpy()
            except (RuntimeError, TypeError):  # grad mode on for a tensor requiring grad; a conjugate or negative bit
                a[i] = to_numpy(x.detach())
        for i in bfloat16:
            a[i] = to_numpy(a[i])
        out = fn(*a)
        if type(out) is ndarray:
            return arrays.from_numpy(out)
        if type(out) is tuple and all(type(o) is ndarray for o in out):  # several gradients
            return tuple(map(arrays.from_numpy, out))
        return map_outputs(out, arrays.from_numpy)

    return run


def _via_host(decl: OpDecl, fn: Callable[..., Any], device: Any) -> Callable[..., Any]:
    """Run a CPU kernel on device tensors: copy in, run, copy results and mutated arguments back."""
    slots = array_slots(decl)

    def run(*args: Any) -> Any:
        conv = map_arrays(decl, args, lambda t: t.detach().cpu(), slots)
        out = fn(*conv)
        _copy_back(decl, args, conv, lambda d, s: d.copy_(s))
        return map_outputs(out, lambda t: t.to(device))

    return run


def _copy_back(decl: OpDecl, originals: Sequence[Any], converted: Sequence[Any], copy: Callable[[Any, Any], None]) -> None:
    """After an in-place op ran on converted arrays, write mutated ones back into the caller's."""
    for name in decl.mutates:
        i = decl.index(name)
        a, b = originals[i], converted[i]
        if isinstance(a, (list, tuple)):
            for x, y in zip(a, b):
                copy(x, y)
        elif arrays.is_array(a):
            copy(a, b)


def _torch_into(dst: torch.Tensor, src: Any) -> None:
    src_t = src if isinstance(src, torch.Tensor) else arrays.from_numpy(src)
    if src_t.data_ptr() != dst.data_ptr():
        with torch.no_grad():
            dst.copy_(src_t)


def _numpy_into(dst: np.ndarray, src: Any) -> None:
    src_a = src if isinstance(src, np.ndarray) else arrays.to_numpy(src)
    if not np.shares_memory(src_a, dst):
        np.copyto(dst, src_a)


def _as_0d(x: Any) -> Any:
    return np.asarray(x) if isinstance(x, np.generic) else x


def _as_torch(value: Any) -> Any:
    return arrays.from_numpy(value) if isinstance(value, (np.ndarray, np.generic)) else value
