"""Running an algorithm on torch.distributed: waits with timeouts, errors, async work handles.

An algorithm is a generator: it issues c10d operations with ``async_op=True`` and yields their work
handles (one, a list, or None: nothing to wait for), and returns its result. :func:`execute` drives it:

* GPU engines (NCCL, RCCL) order work on CUDA streams, so a wait costs the host nothing: the whole
  algorithm is issued at once in the calling thread, synchronous or not.
* gloo waits on the host. A synchronous call is driven in the calling thread. An asynchronous one
  issues its first transfer in the calling thread and continues on the group's *lane*, one thread
  per group that runs multi-step calls in the order they were made, so every rank issues the same
  transfers in the same order. While a lane holds work, later calls on that group queue behind it.
  A single-transfer call (the ``native`` algorithms) needs no lane: its work handle is wrapped.

Every engine failure (a peer died, a wait ran past the timeout) becomes :class:`CommError`.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from typing import Any, Callable, Generator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from hal.dist import settings
from hal.dist.errors import CommError
from hal.dist.groups import GroupInfo
from hal.errors import HalError

Pending = Union[None, Any, Sequence[Any]]  # c10d Work handle(s) a step waits for
Steps = Generator[Pending, None, Any]

GPU_ENGINES = ("nccl", "rccl")

# torch 2.13 renamed the single-tensor collectives; older releases (the GPU images) have the old names.
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_INTO = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: tag of hal's own point-to-point transfers on gloo, apart from a user's untagged send/recv.
P2P_TAG = 0x4841
#: shard size from which exchange_all_gather sends point to point on gloo (measured crossover).
P2P_MIN_BYTES = 1 << 18


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: Any, async_op: bool = True) -> Any:
    """Start gathering every rank's ``shard`` into ``out`` (rank order along dim 0)."""
    return _ALL_GATHER_INTO(out, shard, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, op: Any, group: Any, async_op: bool = True) -> Any:
    """Start reducing ``inp`` over the group; this rank's slice of dim 0 lands in ``out``."""
    return _REDUCE_SCATTER_INTO(out, inp, op=op, group=group, async_op=async_op)


def exchange_all_gather(out: torch.Tensor, shard: torch.Tensor, gi: GroupInfo) -> Pending:
    """Start an all-gather of equal shards into ``out``, the fastest way the engine offers.

    gloo's own all-gather relays every shard around a ring and copies it twice; sending the shard
    straight to each peer is about 2x faster there for shards of 256 KiB and more (below that,
    gloo's point-to-point latency loses). GPU engines use their own.
    """
    if gi.engine != "gloo" or shard.numel() * shard.element_size() < P2P_MIN_BYTES:
        return all_gather_into(out, shard, gi.group)
    rows = out.view(gi.size, -1)
    rows[gi.rank].copy_(shard.view(-1))
    works = []
    for step in range(1, gi.size):
        to = gi.global_ranks[(gi.rank + step) % gi.size]
        frm_index = (gi.rank - step) % gi.size
        works.append(dist.isend(shard.view(-1), to, group=gi.group, tag=P2P_TAG))
        works.append(dist.irecv(rows[frm_index], gi.global_ranks[frm_index], group=gi.group, tag=P2P_TAG))
    return works


def _as_list(pending: Pending) -> list[Any]:
    if pending is None:
        return []
    if isinstance(pending, (list, tuple)):
        return list(pending)
    return [pending]


def _wait(pending: Pending, bound: Optional[datetime.timedelta]) -> None:
    """Wait for c10d work (one handle, a list, or None), each no longer than ``bound`` when given."""
    if pending is None:
        return
    if isinstance(pending, (list, tuple)):
        for work in pending:
            _wait(work, bound)
    elif bound is None:
        pending.wait()
    else:
        pending.wait(bound)


class Run:
    """One call in execution: the algorithm's steps, its group, its timeout, what it returns."""

    __slots__ = ("steps", "what", "gi", "timeout_s", "bound", "post")

    def __init__(self, steps: Steps, what: str, gi: GroupInfo, post: Callable[[Any], Any]) -> None:
        self.steps, self.what, self.gi, self.post = steps, what, gi, post
        self.timeout_s = settings.timeout()
        # gloo waits on the host and honours a bound; GPU engines wait on streams (their watchdog times out)
        use = self.timeout_s is not None and gi.engine == "gloo"
        self.bound = datetime.timedelta(seconds=self.timeout_s) if use else None

    def failure(self, exc: BaseException) -> CommError:
        """The CommError for an engine failure during this call."""
        bound = f"{self.timeout_s:g} s (hal.dist.set_timeout)" if self.timeout_s else "the process group's timeout"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CommError(
            f"{self.what} on a group of {self.gi.size} ranks ({self.gi.engine}) failed at group rank {self.gi.rank}: "
            f"{first}. A peer rank died, stalled past {bound}, or called a different collective. The process group "
            "cannot be used after this: destroy it and restart the job (torchrun restarts the ranks)."
        )


_START = object()


def drive(run: Run, pending: Any = _START) -> Any:
    """Run the steps to the end in this thread (from the start, or on from ``pending``); the result."""
    steps = run.steps
    try:
        if pending is _START:
            pending = next(steps)
        while True:
            _wait(pending, run.bound)
            pending = steps.send(None)
    except StopIteration as done:
        return run.post(done.value)
    except HalError:
        raise
    except RuntimeError as exc:  # c10d reports engine failures and timeouts as RuntimeError subclasses
        raise run.failure(exc) from exc


def _first(run: Run) -> tuple[bool, Any]:
    """Run the steps up to their first transfers: (True, their work) or (False, the result)."""
    try:
        return True, next(run.steps)
    except StopIteration as done:  # nothing to transfer (an empty tensor)
        return False, run.post(done.value)
    except HalError:
        raise
    except RuntimeError as exc:
        raise run.failure(exc) from exc


def _done(value: Any, device: Optional[torch.device] = None) -> torch.futures.Future:
    """A completed future (on a GPU it records the current stream, so waiters order after it)."""
    cuda = device is not None and device.type == "cuda"
    future = torch.futures.Future(devices=[device]) if cuda else torch.futures.Future()
    future.set_result(value)
    return future


class Work:
    """An asynchronous hal.dist call in flight (what ``async_op=True`` returns).

    ``wait()`` returns the call's result (the tensor for in-place collectives, the new tensor for
    the others) or raises its error; ``get_future()`` gives a ``torch.futures.Future`` of the same
    result, as ``DistributedDataParallel`` communication hooks return.
    """

    def __init__(
        self, *, future: Optional[torch.futures.Future] = None, run: Optional[Run] = None, pending: Pending = None
    ) -> None:
        self._future, self._run, self._pending = future, run, pending
        self._lock = threading.Lock()
        self._result: Any = None
        self._finished = False

    def _finish(self) -> Any:
        """Run the remaining (non-communicating) steps of a direct call once; return its result."""
        with self._lock:
            if not self._finished:
                assert self._run is not None
                self._result = drive(self._run, None)
                self._finished = True
            return self._result

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the call is done and return its result; CommError after ``timeout`` seconds."""
        if self._future is not None:
            if timeout is not None:
                deadline = time.monotonic() + timeout
                while not self._future.done():
                    if time.monotonic() > deadline:
                        raise CommError(f"a hal.dist call did not complete within {timeout:g} s")
                    time.sleep(0.0005)
            return self._future.wait()
        run = self._run
        assert run is not None
        bound = datetime.timedelta(seconds=timeout) if timeout is not None and run.gi.engine == "gloo" else run.bound
        try:
            _wait(self._pending, bound)
        except HalError:
            raise
        except RuntimeError as exc:
            raise run.failure(exc) from exc
        return self._finish()

    def is_completed(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return all(w.is_completed() for w in _as_list(self._pending))

    def get_future(self) -> torch.futures.Future:
        """A future of the result (completed by the engine's thread, or by hal's lane on gloo)."""
        if self._future is not None:
            return self._future
        works = _as_list(self._pending)

        def finish(done: torch.futures.Future) -> Any:
            for f in done.value():
                f.value()  # raises the engine's error, if any
            return self._finish()

        return torch.futures.collect_all([w.get_future() for w in works]).then(finish)


class _Lane:
    """One thread per process group running hal's multi-step asynchronous calls in call order."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[tuple[Callable[[], Any], torch.futures.Future]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0  # calls queued or running
        self._thread: Optional[threading.Thread] = None

    def submit(self, job: Callable[[], Any]) -> torch.futures.Future:
        future = torch.futures.Future()
        with self._lock:
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hal.dist lane", daemon=True)
                self._thread.start()
        self._queue.put((job, future))
        return future

    def _loop(self) -> None:
        while True:
            job, future = self._queue.get()
            try:
                result = job()
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                with self._lock:
                    self.pending -= 1


_lanes: dict[Any, _Lane] = {}
_lanes_lock = threading.Lock()


def _lane(gi: GroupInfo) -> _Lane:
    found = _lanes.get(gi.group)
    if found is None:
        with _lanes_lock:
            found = _lanes.setdefault(gi.group, _Lane())
    return found


def execute(run: Run, async_op: bool, single_step: bool, device: torch.device) -> Any:
    """Run a call; its result, or a :class:`Work` when ``async_op`` (see the module doc for where)."""
    if run.gi.engine in GPU_ENGINES:
        result = drive(run)
        return Work(future=_done(result, device)) if async_op else result
    lane = _lane(run.gi)
    if lane.pending:  # keep hal's calls on this group in call order behind the queued ones
        future = lane.submit(lambda: drive(run))
        return Work(future=future) if async_op else future.wait()
    if not async_op:
        return drive(run)
    started, value = _first(run)
    if not started:
        return Work(future=_done(value))
    if single_step:
        return Work(run=run, pending=value)
    return Work(future=lane.submit(lambda: drive(run, value)))
