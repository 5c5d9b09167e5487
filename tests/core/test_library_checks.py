"""hal.library refuses, at registration or at the call, what used to reach the caller silently:
kernels returning the wrong shape, dtype or array type, or None; an unknown array API; unknown
dtype names; a backward op that is never declared. Declarations last for the process, so the
registrations run in one fresh interpreter (SCRIPT) and each test reads its part of the outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    r'''
    import json, os, sys
    import numpy as np, torch, hal, hal.library
    from hal.types import Tensor
    from hal.conformance.cases import Call, case, register_cases
    from hal.conformance.runner import Suite

    torch.manual_seed(int(sys.argv[1]))
    outcome = {}

    def attempt(name, fn):
        try:
            value = fn()
        except Exception as exc:
            outcome[name] = {"raised": type(exc).__name__, "message": str(exc)}
            return None
        outcome[name] = {"raised": None, "type": type(value).__name__}
        return value

    @hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE)
    def cube(x: Tensor) -> Tensor:
        """x**3"""

    @cube.fake
    def _(a):
        return a["x"].new_empty(a["x"].shape)

    x = torch.randn(4, 5)
    kernels = {  # each forced in turn; priority 0 keeps them out of unforced calls
        "wrong_shape_dtype": (lambda x: (x**3)[:-1].double(), None),
        "none": (lambda x: None, None),
        "ndarray": (lambda x: (x**3).numpy(), None),
        "tensor_from_numpy": (lambda x: torch.from_numpy(x**3), "numpy"),
        "good_numpy": (lambda x: x**3, "numpy"),
        "good_torch": (lambda x: x**3, None),
        "wide_is_wrong": (lambda x: x**3 if x.shape[-1] < 10 else (x**3).double(), None),
    }
    for name, (fn, api) in kernels.items():
        hal.library.register_kernel("cube", backend="cpu", name=name, array_api=api)(fn)
    for name in kernels:
        for call in ("first", "second"):
            with hal.use(kernel={"cube": name}):
                y = attempt(f"{name}/{call}", lambda: hal.ops.cube(x))
            if y is not None:
                same = isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype
                outcome[f"{name}/{call}"]["right"] = bool(same and torch.allclose(y, x**3))
    with hal.use(kernel={"cube": "good_torch"}):
        attempt("good_torch/numpy caller", lambda: hal.ops.cube(x.numpy()))

    wide = torch.randn(3, 12)
    with hal.use(kernel={"cube": "wide_is_wrong"}):
        attempt("wide_is_wrong/wide", lambda: hal.ops.cube(wide))  # after its first call: not checked
        os.environ["HAL_DEBUG"] = "1"
        hal.dispatch.reset()
        attempt("wide_is_wrong/wide, HAL_DEBUG=1", lambda: hal.ops.cube(wide))
        del os.environ["HAL_DEBUG"]
        hal.dispatch.reset()
        attempt("wide_is_wrong/wide again", lambda: hal.ops.cube(wide))
        with hal.library.checking_results():
            attempt("wide_is_wrong/wide, checking_results", lambda: hal.ops.cube(wide))

    attempt("register array_api=jax", lambda: hal.library.register_kernel("cube", backend="cpu", name="jax", array_api="jax")(lambda x: x**3))
    def jax_call():
        with hal.use(kernel={"cube": "jax"}):
            return hal.ops.cube(x)

    attempt("jax kernel called", jax_call)  # before: an ndarray for a torch caller
    attempt("define_backend array_api=jax", lambda: hal.library.define_backend("jaxed", priority=1, device_types=("cpu",), array_api="jax"))
    outcome["jaxed defined"] = "jaxed" in [b.name for b in hal.backends()]

    def float7():
        @hal.library.declare(dtypes=("float7",), tolerances=hal.library.ELEMENTWISE)
        def f7(x: Tensor) -> Tensor:
            """x"""
    attempt("declare float7", float7)
    outcome["f7 declared"] = "f7" in hal.list_ops()

    def untyped():
        @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)
        def untyped_op(x, scale: float = 1.0) -> Tensor:
            """x * scale"""

    def listed():
        @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)
        def listed_op(x: Tensor, sizes: list) -> Tensor:
            """x"""

    def variadic():
        @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE)
        def variadic_op(x: Tensor, *more: Tensor) -> Tensor:
            """x"""

    for name, fn in (("untyped", untyped), ("listed", listed), ("variadic", variadic)):
        attempt(f"declare {name}", fn)
        outcome[f"{name} declared"] = f"{name}_op" in hal.list_ops()

    @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE, backward="twice_backward", gradients="x")
    def twice(x: Tensor) -> Tensor:
        """2 x"""

    @twice.fake
    def _(a):
        return a["x"].new_empty(a["x"].shape)

    attempt("twice kernel, backward undeclared", lambda: hal.library.register_kernel("twice", backend="cpu", name="torch")(lambda x: 2 * x))
    xs = torch.randn(6)
    attempt("twice with grad, backward undeclared", lambda: hal.ops.twice(xs.clone().requires_grad_(True)))

    @hal.library.declare(dtypes=("float32",), tolerances=hal.library.ELEMENTWISE, forward="twice")
    def twice_backward(grad_out: Tensor, x: Tensor) -> Tensor:
        """2 grad_out"""

    @twice_backward.fake
    def _(a):
        return a["grad_out"].new_empty(a["grad_out"].shape)

    hal.library.register_kernel("twice", backend="cpu", name="torch")(lambda x: 2 * x)
    hal.library.register_kernel("twice_backward", backend="cpu", name="torch")(lambda grad_out, x: 2 * grad_out)
    attempt("twice without grad", lambda: hal.ops.twice(xs))
    xg = xs.clone().requires_grad_(True)
    attempt("twice with grad, backward declared since", lambda: hal.ops.twice(xg).sum().backward())
    outcome["twice grad right"] = bool(xg.grad is not None and torch.equal(xg.grad, torch.full_like(xs, 2.0)))

    # a fake rule that is wrong for wide inputs, a kernel and reference that agree: normal calls
    # of narrow inputs pass, the conformance run checks each case against the fake
    @hal.library.declare(dtypes=("float32", "float64"), tolerances=hal.library.ELEMENTWISE)
    def sq(x: Tensor) -> Tensor:
        """x**2"""

    @sq.fake
    def _(a):
        t = a["x"]
        return t.new_empty(t.shape if t.shape[-1] < 10 else t.shape[:-1])

    @hal.library.register_kernel("sq", backend="cpu_ref", name="numpy")
    def sq_ref(x):
        return (np.asarray(x, np.float64) ** 2).astype(x.dtype)

    hal.library.register_kernel("sq", backend="cpu", name="torch", priority=100)(lambda x: x * x)
    attempt("sq narrow", lambda: hal.ops.sq(x))

    def draw(d, shape):
        return Call({"x": d.normal(*shape)})

    register_cases("sq", [case("narrow", draw, quick=True, shape=(3, 5)), case("wide", draw, shape=(7, 13))])
    suite = Suite(backend="cpu", ops=["sq"])
    outcome["sq conformance"] = {r.id: [r.status, r.reason] for r in suite.run(suite.plan())}
    print(json.dumps(outcome))
    '''
)


@pytest.fixture(scope="module")
def outcome() -> dict:
    seed = int(os.environ.get("HAL_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    env = {k: v for k, v in os.environ.items() if k != "HAL_DEBUG"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, f"seed={seed}\n" + out.stdout[-3000:] + out.stderr[-6000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _refused(outcome: dict, name: str, error: str, *words: str) -> str:
    got = outcome[name]
    assert got["raised"] == error, (name, got)
    assert all(w in got["message"] for w in words), (name, got["message"])
    return got["message"]


@pytest.mark.parametrize("call", ["first", "second"])
def test_a_kernel_returning_the_wrong_shape_and_dtype_is_refused(outcome: dict, call: str) -> None:
    """Before: (x**3)[:-1].double() reached the caller, a float64 (3, 5) tensor for a float32
    (4, 5) input. Its first call is checked against the op's fake rule; it raised there, so its
    second call is its first to complete and is checked too."""
    _refused(outcome, f"wrong_shape_dtype/{call}", "KernelResultError", "kernel cpu/wrong_shape_dtype of cube",
             "float64 torch.Tensor of shape (3, 5)", "fake rule gives a float32 torch.Tensor of shape (4, 5)")


@pytest.mark.parametrize("call", ["first", "second"])
def test_a_kernel_returning_none_is_refused_at_every_call(outcome: dict, call: str) -> None:
    _refused(outcome, f"none/{call}", "KernelResultError", "kernel cpu/none of cube returned None",
             "writes nothing in place", "shape (4, 5)")


@pytest.mark.parametrize("call", ["first", "second"])
def test_a_kernel_returning_the_other_array_type_is_refused(outcome: dict, call: str) -> None:
    """Before: a torch kernel's ndarray reached a torch caller as an ndarray."""
    _refused(outcome, f"ndarray/{call}", "KernelResultError", "numpy.ndarray", "array_api='torch'", "register it with array_api='numpy'")
    _refused(outcome, f"tensor_from_numpy/{call}", "KernelResultError", "torch.Tensor", "array_api='numpy'", "return numpy.ndarray")


def test_callers_get_their_own_array_type(outcome: dict) -> None:
    assert outcome["good_numpy/first"] == outcome["good_numpy/second"] == {"raised": None, "type": "Tensor", "right": True}
    assert outcome["good_torch/second"] == {"raised": None, "type": "Tensor", "right": True}
    assert outcome["good_torch/numpy caller"] == {"raised": None, "type": "ndarray"}


def test_results_are_checked_against_the_fake_under_hal_debug_and_checking_results(outcome: dict) -> None:
    """A kernel right on its first call and wrong on another: outside a full check the later call
    is not compared with the fake rule (each call's cost stays one isinstance test); HAL_DEBUG=1
    (read again at hal.dispatch.reset()) and hal.library.checking_results() check every call."""
    assert outcome["wide_is_wrong/first"]["raised"] is None and outcome["wide_is_wrong/first"]["right"]
    assert outcome["wide_is_wrong/wide"]["raised"] is None and outcome["wide_is_wrong/wide again"]["raised"] is None
    for name in ("wide_is_wrong/wide, HAL_DEBUG=1", "wide_is_wrong/wide, checking_results"):
        _refused(outcome, name, "KernelResultError", "float64 torch.Tensor of shape (3, 12)", "float32 torch.Tensor of shape (3, 12)")


def test_an_unknown_array_api_is_refused_at_registration(outcome: dict) -> None:
    """Before: array_api="jax" was accepted, and the kernel's results came back as ndarrays."""
    _refused(outcome, "register array_api=jax", "InvalidArgumentError", "argument 'array_api'", "'jax'")
    _refused(outcome, "jax kernel called", "InvalidArgumentError", "'jax'")
    _refused(outcome, "define_backend array_api=jax", "InvalidArgumentError", "hal.library.define_backend", "argument 'array_api'")
    assert outcome["jaxed defined"] is False


def test_an_unknown_dtype_name_is_refused_at_declaration(outcome: dict) -> None:
    _refused(outcome, "declare float7", "InvalidArgumentError", "argument 'dtypes'", "'float7': no torch dtype")
    assert outcome["f7 declared"] is False


@pytest.mark.parametrize("name, param, words", [
    ("untyped", "x", ("no annotation on parameter 'x' of 'untyped_op'",)),
    ("listed", "sizes", ("<class 'list'> on parameter 'sizes' of 'listed_op'",)),
    ("variadic", "more", ("variadic positional parameter 'more'", "no *args")),
])
def test_a_parameter_the_schema_cannot_hold_is_refused_at_declaration(outcome: dict, name: str, param: str, words: tuple) -> None:
    """Before: a bare TypeError from hal.integration's schema (or hal.registry) after the op's name
    was taken, so it appeared in hal.list_ops(). Now an InvalidArgumentError naming the parameter
    and the annotations hal takes, and nothing is declared."""
    message = _refused(outcome, f"declare {name}", "InvalidArgumentError", "hal.library.declare", f"argument '{param}'", *words)
    if name != "variadic":
        assert "hal.types.Tensor" in message and "for static options" in message
    assert outcome[f"{name} declared"] is False


def test_an_undeclared_backward_op_is_refused_when_a_kernel_is_registered(outcome: dict) -> None:
    """Before: KeyError listing every op at the first call needing autograd. The backward op may be
    declared after its forward op, so the declaration is accepted; registering a kernel of the
    forward op before it is declared is refused naming it (a call with grad before then, on no
    kernel, raises UnsupportedError), and once it is declared kernels register and autograd works."""
    _refused(outcome, "twice kernel, backward undeclared", "InvalidArgumentError", "hal.library.register_kernel",
             "'twice_backward'", "forward='twice'", "not declared")
    _refused(outcome, "twice with grad, backward undeclared", "UnsupportedError", "twice")  # no kernel was registered
    assert outcome["twice without grad"]["raised"] is None
    assert outcome["twice with grad, backward declared since"]["raised"] is None and outcome["twice grad right"]


def test_conformance_checks_each_case_against_the_fake(outcome: dict) -> None:
    """A kernel and a reference that agree, and a fake rule wrong for wide inputs (what
    torch.compile would trace with): the conformance run fails that case and names the fake."""
    assert outcome["sq narrow"]["raised"] is None
    runs = outcome["sq conformance"]
    wide = {k: v for k, v in runs.items() if "wide" in k and "torch" in k}
    narrow = {k: v for k, v in runs.items() if "narrow" in k and "torch" in k}
    assert narrow and all(status == "pass" for status, _ in narrow.values()), runs
    assert wide and all(status in ("fail", "error") and "KernelResultError" in reason and "fake rule" in reason
                        for status, reason in wide.values()), runs
