"""Comparison helpers of the reference backend's tests: float64 torch peers, canonical arguments,
dtype casts, vector-Jacobian products and tolerance checks."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hal.arrays import dtype_name, from_numpy, to_numpy, torch_dtype


def randn(rng: np.random.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard-normal CPU tensor (never zeros)."""
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


def assert_close64(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    """Float64 comparison of a reference kernel against torch, with the error in the message."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


LOW_PRECISION = ("float32", "float16", "bfloat16")

#: PyTorch's activations under hal's names (ops.elementwise.ACTIVATIONS).
TORCH_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda z: z,
    "relu": torch.nn.functional.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}


def canonical(entry: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
    """The canonical argument tuple a kernel (and ``hal_torch``) receives for ``entry(*args, **kwargs)``."""
    decl = entry.op
    bound = inspect.signature(entry).bind(*args, **kwargs)
    bound.apply_defaults()
    values = [bound.arguments[n] for n in decl.param_names]
    for name, value in (decl.check(*values) or {}).items():
        values[decl.index(name)] = value
    return tuple(values)


def map_tensors(args: Sequence[Any], fn: Callable[[torch.Tensor], Any]) -> list[Any]:
    """``fn`` applied to every tensor among ``args`` (other values kept)."""
    return [fn(a) if isinstance(a, torch.Tensor) else a for a in args]


def cast_floats(args: Sequence[Any], dtype: str) -> list[Any]:
    """Fresh copies of the arguments with floating tensors rounded to ``dtype`` (int tensors kept)."""
    return map_tensors(args, lambda t: t.to(torch_dtype(dtype)) if t.is_floating_point() else t.clone())


def as_numpy(args: Sequence[Any]) -> list[Any]:
    """The arguments as NumPy arrays (bfloat16 as ml_dtypes.bfloat16), sharing memory with the tensors."""
    return map_tensors(args, to_numpy)


def as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def vjp(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], grad_out: torch.Tensor) -> tuple:
    """Gradients of ``fn(*inputs)`` with respect to every input, by torch autograd (inputs untouched)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, grad_out)


def assert_all_close64(got: Any, want: Any, **tol: float) -> None:
    """``assert_close64`` over matching tuples of results (torch tensors)."""
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want), f"{len(got)} results, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, torch.Tensor), f"result {i} is a {type(g).__name__}, expected a torch.Tensor"
        try:
            assert_close64(g, w, **tol)
        except AssertionError as exc:
            raise AssertionError(f"result {i}: {exc}") from None


def assert_within_tolerance(
    entry: Callable[..., Any], call_args: Sequence[Any], got: Any, want: Any, array: str, dtype: str | Sequence[str]
) -> None:
    """Results of ``entry(*call_args)`` against float64 torch ones computed from the same (rounded)
    inputs: each result an array of type ``array`` ("torch" or "numpy") and dtype ``dtype`` (one
    for all results, or one per result), of the reference's shape, and within the op's declared
    tolerance for that dtype (widened by the op's reduction length)."""
    decl = entry.op
    k = decl.reduction(decl.bind(canonical(entry, *call_args))) if decl.reduction else 1
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want), f"{len(got)} results, expected {len(want)}"
    dtypes = [dtype] * len(got) if isinstance(dtype, str) else list(dtype)
    for i, (g, w, dtype) in enumerate(zip(got, want, dtypes)):
        kind = np.ndarray if array == "numpy" else torch.Tensor
        assert isinstance(g, kind), f"result {i} is a {type(g).__name__}, expected {kind.__name__}"
        assert dtype_name(g) == dtype, f"result {i} has dtype {dtype_name(g)}, expected {dtype}"
        g_t = from_numpy(g) if array == "numpy" else g
        assert tuple(g_t.shape) == tuple(w.shape), f"result {i}: shape {tuple(g_t.shape)} != {tuple(w.shape)}"
        atol, rtol = decl.tolerances[dtype].widened(k)
        torch.testing.assert_close(g_t.double(), w.double(), atol=atol, rtol=rtol, msg=lambda m: f"result {i}: {m}")


def check_in_dtype(sample: Callable[[np.random.Generator], tuple], dtype: str, array: str, rng: np.random.Generator) -> None:
    """One call drawn by ``sample(rng) -> (entry, args, reference)``, its inputs rounded to ``dtype``
    and passed as torch tensors or NumPy arrays, against the reference in float64 on the same values."""
    entry, args, reference = sample(rng)
    rounded = cast_floats(args, dtype)
    want = reference(*cast_floats(rounded, "float64"))
    got = entry(*(as_numpy(rounded) if array == "numpy" else rounded))
    assert_within_tolerance(entry, rounded, got, want, array, dtype)
