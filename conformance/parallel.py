"""``hal conformance --jobs N``: the planned cases split by op over N worker processes.

A full run on a GPU is bound by the host: Triton compiles each kernel specialisation once, and the
float64 references run on the CPU. Worker processes share those costs out over the host's cores;
each takes whole ops (so a kernel is compiled in one process only), balanced by case count.

A worker builds its own :class:`~.runner.Suite` with the parent's settings and the ops of its
shard, runs its cases in plan order, and writes each result record as a JSON line to its stdout
(xfail list already applied). The parent reads the records as they come, feeds the progress bar and
returns the results in the order of the parent's plan. A worker that dies (a CUDA fatal error, an
out-of-memory kill) costs only its remaining cases: they are reported as errors with the worker's
exit status and the end of its stderr. An interrupt (Ctrl-C, a time limit's SIGINT) stops the
workers and reports what finished.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any, Callable, Optional, Sequence

from .runner import Planned, Result, Suite

#: The Suite settings a worker copies from the parent.
SETTINGS = ("backend", "device", "seed", "quick", "dtypes", "xfail_file", "tolerance_file", "poison", "strict_xpass")
#: Marks a worker's result lines (anything else a kernel library prints on stdout is ignored).
_PREFIX = "hal-conformance-result "
_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(Result))


def shard_ops(plan: Sequence[Planned], jobs: int) -> list[list[str]]:
    """The ops of ``plan`` in at most ``jobs`` groups of about equal case counts (largest op first,
    each to the lightest group); empty groups are dropped."""
    counts = collections.Counter(p.op for p in plan)
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, min(jobs, len(counts))))]
    for op, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        i = min(range(len(groups)), key=lambda j: groups[j][0])
        groups[i] = (groups[i][0] + n, groups[i][1] + [op])
    return [ops for _, ops in groups if ops]


def run_parallel(suite: Suite, settings: dict[str, Any], plan: Sequence[Planned], jobs: int, progress: Optional[Callable[[Result], None]] = None) -> list[Result]:
    """Run ``plan`` in up to ``jobs`` worker processes; ``settings`` are the Suite keyword
    arguments (:data:`SETTINGS`) that built ``suite``. Results come back in plan order."""
    shards = shard_ops(plan, jobs)
    records: "queue.Queue[tuple[int, Optional[dict[str, Any]]]]" = queue.Queue()
    workers = []
    for i, ops in enumerate(shards):
        config = {k: settings[k] for k in SETTINGS} | {"ops": ops}
        err = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen(
            [sys.executable, "-m", __name__, json.dumps(config)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None
        threading.Thread(target=_read_records, args=(i, proc.stdout, records), daemon=True).start()
        workers.append((proc, err))
    got: dict[str, Result] = {}
    open_workers, interrupted = len(workers), False
    try:
        while open_workers:
            _, rec = records.get()
            if rec is None:
                open_workers -= 1
                continue
            r = Result(**{k: rec[k] for k in _RESULT_FIELDS if k in rec})
            got[r.id] = r
            if progress is not None:
                progress(r)
    except KeyboardInterrupt:  # Ctrl-C or a time limit: report what finished
        interrupted = True
        for proc, _ in workers:
            proc.kill()
    why = {}
    for i, (proc, err) in enumerate(workers):
        code = proc.wait()
        err.seek(0)
        tail = " ".join(err.read()[-800:].split())
        err.close()
        if interrupted:
            why[i] = "the run was interrupted before this case ran"
        else:
            why[i] = f"conformance worker {i + 1}/{len(workers)} (ops {', '.join(shards[i])}) exited with status {code} before this case ran: {tail or 'no output on stderr'}"
    shard_of = {op: i for i, ops in enumerate(shards) for op in ops}
    out = []
    for p in plan:
        r = got.get(p.id)
        if r is None:
            r = Result(p.op, p.kernel, p.dtype, p.case, "error", reason=why[shard_of[p.op]])
            suite.apply_xfail(r)
            if progress is not None:
                progress(r)
        out.append(r)
    return out


def _read_records(index: int, stream: IO[str], records: "queue.Queue[tuple[int, Optional[dict[str, Any]]]]") -> None:
    """Forward each JSON line of a worker's stdout; ``None`` marks the end of the stream."""
    try:
        for line in stream:
            if line.startswith(_PREFIX):
                records.put((index, json.loads(line[len(_PREFIX):])))
    finally:
        records.put((index, None))


def worker(config: dict[str, Any]) -> int:
    """A worker's main: run the shard's plan, one JSON record per line on stdout."""
    suite = Suite(**config)
    for p in suite.plan():
        print(_PREFIX + json.dumps(suite.run_case(p).record(), allow_nan=False), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker(json.loads(sys.argv[1])))
