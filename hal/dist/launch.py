"""Start a process group of local ranks and run a function on each: for tests, conformance, bench.

This is a convenience for one machine (the CPU with gloo, or the local GPUs with NCCL/RCCL, one
rank per GPU); hal.dist itself only ever runs on process groups someone else created. CPU ranks
are forked from a ``forkserver`` that has imported torch and hal already, so a group of 4 starts
in well under a second after the first (GPU ranks are spawned afresh); they meet through a
``file://`` store in a fresh directory
(no ports to pick). Every launch ends: ranks still running at the deadline are killed, and each
rank's return value or error comes back as a :class:`RankResult`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

#: imported once by the fork server, so that ranks start without importing torch again. Append to
#: it before the first launch of a process (e.g. "torch._dynamo", which DDP imports: 5 s per rank).
PRELOAD = ["torch", "torch.distributed", "hal", "hal.dist"]


@dataclasses.dataclass
class RankResult:
    """What one rank returned, or how it failed."""

    rank: int
    ok: bool
    value: Any = None
    #: qualified names of the error's class and its bases ("hal.errors.HalError", ...).
    error_types: tuple[str, ...] = ()
    message: str = ""
    traceback: str = ""
    exitcode: Optional[int] = None
    seconds: float = 0.0  # time inside the function (from before it was called to its end)

    def raised(self, name: str) -> bool:
        """True when the rank failed with an error of the class named ``name`` (or a subclass)."""
        return any(t == name or t.endswith("." + name) for t in self.error_types)


@dataclasses.dataclass
class _Spec:
    target: str  # "module:function"
    paths: list[str]
    world_size: int
    args: tuple[Any, ...]
    backend: str
    folder: str
    pg_timeout_s: float
    env: dict[str, str]
    threads: int
    final_barrier: bool


def _target_name(fn: Union[str, Callable[..., Any]]) -> tuple[str, list[str]]:
    """("module:function", sys.path entries the ranks need to import it)."""
    if isinstance(fn, str):
        return fn, []
    module = sys.modules[fn.__module__]
    paths = []
    if getattr(module, "__file__", None):
        root = os.path.dirname(os.path.abspath(module.__file__))
        for _ in range(fn.__module__.count(".")):
            root = os.path.dirname(root)
        paths.append(root)
    return f"{fn.__module__}:{fn.__qualname__}", paths


def _resolve(target: str) -> Callable[..., Any]:
    module_name, _, name = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _write(folder: str, result: RankResult) -> None:
    path = os.path.join(folder, f"rank{result.rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)


def _rank_main(rank: int, spec: _Spec) -> None:
    os.environ.update(spec.env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(spec.world_size))
    # numba's thread pool (hal's CPU kernels) would take every core in every rank: as torch, `threads`
    os.environ.setdefault("NUMBA_NUM_THREADS", str(spec.threads))
    if "numba" in sys.modules:  # imported by the fork server already: its pool size is fixed, use fewer
        numba = sys.modules["numba"]
        numba.set_num_threads(min(spec.threads, numba.config.NUMBA_NUM_THREADS))
    sys.path[:0] = [p for p in spec.paths if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    started = time.monotonic()
    try:
        if spec.backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            spec.backend,
            init_method="file://" + os.path.join(spec.folder, "store"),
            rank=rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
        )
        started = time.monotonic()
        value = _resolve(spec.target)(rank, spec.world_size, *spec.args)
        result = RankResult(rank, True, value, seconds=time.monotonic() - started)
    except BaseException as exc:  # reported to the parent, whatever it is
        names = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__)
        result = RankResult(
            rank, False, None, names, f"{type(exc).__name__}: {exc}", traceback.format_exc(), seconds=time.monotonic() - started
        )
    _write(spec.folder, result)
    if result.ok and spec.final_barrier:  # let peers finish reading before this rank's connections close
        try:
            dist.barrier(async_op=True).wait(datetime.timedelta(seconds=min(30.0, spec.pg_timeout_s)))
        except Exception:  # a peer that failed cannot join; nothing left to report
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context(backend: str) -> Any:
    """forkserver for CPU ranks; spawn for GPU ranks (a fork must not inherit an initialised CUDA)."""
    if backend != "gloo":
        return multiprocessing.get_context("spawn")
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # platforms without fork
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def _spawnable_main() -> Iterator[None]:
    """Hide a ``__main__.__file__`` that is no file (a script read from stdin): spawn would run it."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path):
        yield
        return
    del main.__file__  # type: ignore[union-attr]
    try:
        yield
    finally:
        main.__file__ = path  # type: ignore[union-attr]


def torch_backend(engine: str) -> str:
    """torch.distributed's backend name for an engine: RCCL is torch's "nccl" backend on ROCm builds."""
    return "nccl" if engine.lower() == "rccl" else engine


def launch(
    fn: Union[str, Callable[..., Any]],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    env: Optional[dict[str, str]] = None,
    threads: int = 1,
    wait_ranks: Optional[Iterable[int]] = None,
    final_barrier: bool = True,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks of a new process group.

    ``fn`` is a module-level function (or "module:function"); its return value must pickle.
    ``env`` is set in every rank (e.g. ``{"LOCAL_WORLD_SIZE": "4"}``). ``backend``: "gloo", or
    "nccl" for one rank per local GPU ("rccl" names the same on a ROCm build: :func:`torch_backend`).
    ``threads``: torch's and numba's threads per rank (1 keeps ranks from oversubscribing the cores;
    ``env`` may set ``NUMBA_NUM_THREADS`` otherwise). The launch returns when every rank of ``wait_ranks`` (default: all)
    has ended or ``timeout_s`` passed; ranks still running then are killed. A rank whose function
    returned waits for the others in a barrier before it exits (``final_barrier=False`` skips it:
    for runs where a rank is meant to fail or hang).
    """
    backend = torch_backend(backend)
    target, paths = _target_name(fn)
    folder = tempfile.mkdtemp(prefix="hal-dist-")
    spec = _Spec(target, paths, world_size, tuple(args), backend, folder, pg_timeout_s, dict(env or {}), threads, final_barrier)
    ctx = _context(backend)
    procs = [ctx.Process(target=_rank_main, args=(r, spec), daemon=True, name=f"hal-rank{r}") for r in range(world_size)]
    try:
        with _spawnable_main():
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout_s
        waited = set(range(world_size) if wait_ranks is None else wait_ranks)
        for r in sorted(waited):
            procs[r].join(max(0.0, deadline - time.monotonic()))
        killed = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                killed.add(r)
            p.join(10)
        return [_collect(folder, r, procs[r].exitcode, r in killed) for r in range(world_size)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _collect(folder: str, rank: int, exitcode: Optional[int], killed: bool) -> RankResult:
    path = os.path.join(folder, f"rank{rank}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            result: RankResult = pickle.load(f)
        result.exitcode = exitcode
        return result
    if killed:
        how = "was still running at the deadline and was killed"
    elif exitcode is not None and exitcode < 0:
        how = f"died of signal {signal.Signals(-exitcode).name}"
    else:
        how = f"exited with code {exitcode}"
    return RankResult(rank, False, None, ("exit",), f"rank {rank} {how} without reporting", exitcode=exitcode)
