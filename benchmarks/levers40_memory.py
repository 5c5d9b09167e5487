"""levers40's ``memory`` and ``largest`` parts: each (configuration, batch) in a fresh process.

Why a process each: a CUDA graph's private pool is reserved memory that a replay does not allocate,
and an earlier configuration in the same process leaves cached blocks, compiled code and pools
behind. So every (configuration, batch) runs in a child process of ``levers40.py`` (the hidden
``--memory-one CONFIG --batch B`` mode; same interpreter, same environment) that builds the model,
runs hal.optimize's one candidate, and prints one JSON line (``ROW`` then the row). Its peaks,
``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()``, are never reset: they cover the
process's whole life from the model's construction on (compile warm-up, graph capture, steady
steps): what the GPU must hold to train that way. The parent reads the rows, turns an out-of-memory
error, a failed child or one past ``--memory-timeout`` into a row with its error, and prints the table.

Configurations (``--memory-configs``): a hal.optimize candidate name (``torch eager`` ... ``hal
compile+graph``), then ``:selective`` or ``:full`` for ``recompute=`` (hal candidates only), then
``+fp8`` (the ``--fp8`` recipe, ``tensor`` by default) or ``+fp8=tensor|delayed|rowwise`` for
``fp8=`` (hal candidates only); or ``torchao tensorwise`` / ``torchao rowwise``: the model converted
by torchao.float8 (levers40's ``torchao`` part), then hal.optimize's ``torch compile+graph`` on it.
Torch candidates run with ``rewrite="none", replace_optimizer=False``: the user's model and fused
AdamW untouched, and no hal variant built beside them (its weight copies would count).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch

#: the prefix of the child's result line
ROW = "LEVERS40_ROW "
#: hal.optimize's candidate names (hal.fast.CANDIDATES, spelt out so that the parent needs no hal)
CANDIDATES = tuple(f"{v} {m}" for v in ("torch", "hal") for m in ("eager", "compile", "graph", "compile+graph"))
FP8_NAMES = ("tensor", "delayed", "rowwise")
TORCHAO_RECIPES = ("tensorwise", "rowwise")
DEFAULT_LARGEST = (4, 6, 8, 12, 16, 24)
EAGER = "torch eager"  # the reference of the ratios


@dataclasses.dataclass(frozen=True)
class Config:
    name: str                      # as written
    candidate: str                 # hal.optimize's only candidate
    policy: Optional[str] = None   # recompute=
    fp8: Optional[str] = None      # a name of FP8_NAMES
    torchao: Optional[str] = None  # a torchao.float8 recipe name


_CONFIG = re.compile(r"^(?P<cand>.+?)(?::(?P<policy>selective|full))?(?P<fp8>\+fp8(?:=(?P<recipe>[a-z]+))?)?$")


def parse_config(text: str, default_fp8: Optional[str] = None) -> Config:
    """``text`` as a :class:`Config` (module docstring); ValueError naming what is wrong."""
    name = text.strip()
    words = name.split()
    if len(words) == 2 and words[0] == "torchao":
        if words[1] not in TORCHAO_RECIPES:
            raise ValueError(f"memory config {name!r}: torchao recipes are {', '.join(TORCHAO_RECIPES)}")
        return Config(name, "torch compile+graph", torchao=words[1])
    m = _CONFIG.match(name)
    if m is None or m["cand"] not in CANDIDATES:
        raise ValueError(f"memory config {name!r}: want a candidate among {', '.join(CANDIDATES)}, then :selective or :full, "
                         f"then +fp8 or +fp8=<{'|'.join(FP8_NAMES)}>; or 'torchao <{'|'.join(TORCHAO_RECIPES)}>'")
    fp8 = (m["recipe"] or default_fp8 or "tensor") if m["fp8"] else None
    if fp8 is not None and fp8 not in FP8_NAMES:
        raise ValueError(f"memory config {name!r}: fp8 recipes are {', '.join(FP8_NAMES)}")
    if m["cand"].startswith("torch ") and (m["policy"] or fp8):
        raise ValueError(f"memory config {name!r}: recompute and fp8 change hal's variant only; a 'torch' candidate runs your model as it is")
    return Config(name, m["cand"], m["policy"], fp8)


def parse_batches(text: str) -> list[int]:
    out = [int(b) for b in text.split(",") if b.strip()]
    if not out or any(b < 1 for b in out):
        raise ValueError(f"batch list {text!r}: want positive integers, comma separated")
    return sorted(set(out))


def parse_largest(text: str, configs: list[str]) -> list[tuple[str, list[int]]]:
    """``--largest-batches``: a plain list for every configuration ("4,6,8"), or entries ``CONFIG=LIST``
    separated by ";" (a plain list among them is the default of the configurations not named).
    Named configurations without a plain list: exactly those run, in the order named; otherwise
    ``configs`` (``--memory-configs``) run, each with its list or the default (the plain list, else
    DEFAULT_LARGEST), then the named ones not among them."""
    default: Optional[list[int]] = None
    named: dict[str, list[int]] = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, eq, batches = entry.rpartition("=")
        if not eq:
            default = parse_batches(entry)
        else:
            parse_config(name)  # fail early on a misspelt configuration
            named[name.strip()] = parse_batches(batches)
    if named and default is None:
        return list(named.items())
    return [(c, named.get(c, default or list(DEFAULT_LARGEST))) for c in configs] + [(c, b) for c, b in named.items() if c not in configs]


# --- the child: one configuration at one batch ---------------------------------------------------

def _is_oom(exc: BaseException) -> bool:
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _memory(row: dict, device: str) -> None:
    """The process's peaks (never reset), what it holds now, and the device's used memory."""
    if device != "cuda":
        return
    gib = 2**30
    try:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - after an error the stream may be unusable; the counters are kept on the host
            pass
        row.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / gib, peak_reserved_gib=torch.cuda.max_memory_reserved() / gib,
                   end_allocated_gib=torch.cuda.memory_allocated() / gib, end_reserved_gib=torch.cuda.memory_reserved() / gib)
        stats = torch.cuda.memory_stats()
        row.update(alloc_retries=stats.get("num_alloc_retries", 0), ooms=stats.get("num_ooms", 0))
        free, total = torch.cuda.mem_get_info()
        row.update(device_used_gib=(total - free) / gib, device_total_gib=total / gib)
    except Exception as exc:  # noqa: BLE001 - a broken context (a sticky CUDA error): the row still goes out
        row["memory_error"] = f"{type(exc).__name__}: {exc}"[:200]


def measure_one(config: Config, batch: int, seq: int, setup: Any) -> dict:
    """The row of ``config`` at ``batch`` in this (fresh) process. ``setup``: levers40's
    ``build()`` (the model on ``device``), ``vocab``, ``bench(fn, reps, warm)``, ``torchao_convert(model,
    recipe)``, ``fp8_kwargs(name)``, ``device``, ``shape`` (a description)."""
    import hal

    device = setup.device
    row: dict[str, Any] = {"config": config.name, "batch": batch, "seq": seq, "shape": setup.shape, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name() if device == "cuda" else device,
                           "fp8": config.fp8, "torchao": config.torchao}
    started = time.perf_counter()
    try:
        model = setup.build()
        if device == "cuda":
            row["model_gib"] = torch.cuda.memory_allocated() / 2**30
        if config.torchao:
            row["converted"] = setup.torchao_convert(model, config.torchao)
        tokens = torch.randint(0, setup.vocab, (batch, seq), device=device)
        kwargs: dict[str, Any] = {"amp": torch.bfloat16, "candidates": [config.candidate]}
        if config.candidate.startswith("torch "):
            kwargs.update(rewrite="none", replace_optimizer=False)
        else:
            kwargs.update(recompute=config.policy, **setup.fp8_kwargs(config.fp8))
        fast = hal.optimize(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), **kwargs)
        for _ in range(4):  # a graph: 2 eager calls, the capture, a replay
            fast(input_ids=tokens, labels=tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        row["first_s"] = time.perf_counter() - started
        ms = setup.bench(lambda: fast(input_ids=tokens, labels=tokens), 8, 1)
        row.update(ms=ms, tokens_per_s=batch * seq / ms * 1e3, loss=float(fast(input_ids=tokens, labels=tokens)),
                   chosen=fast.report.chosen)
        fp8 = getattr(fast.report, "fp8", None)
        if fp8 is not None:
            row["fp8_decision"] = f"{fp8.choice}: {fp8.reason}"
        graph = getattr(fast, "_graph", None)
        if "graph" in config.candidate:
            row["captured"] = bool(graph is not None and graph.captured())
            if not row["captured"] and graph is not None:
                row["graph"] = graph.explain().splitlines()[-1].strip()
        print(fast.explain(), flush=True)
    except Exception as exc:  # noqa: BLE001 - the row carries it
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        row["oom"] = _is_oom(exc)
        row["error"] = ("out of memory: " if row["oom"] else "") + f"{type(exc).__name__}: {message}"[:400]
        if not row["oom"]:
            row["traceback"] = traceback.format_exc()[-3000:]
            print(row["traceback"], flush=True)
    _memory(row, device)
    row["wall_s"] = time.perf_counter() - started
    return row


def child_main(config: str, batch: int, seq: int, setup: Any, default_fp8: Optional[str]) -> None:
    """Measure, print the row, and leave at once: no interpreter teardown (graphs, compiled code and
    worker processes going down can take long or crash after the row is out)."""
    row = measure_one(parse_config(config, default_fp8), batch, seq, setup)
    print(ROW + json.dumps(row, default=str), flush=True)
    sys.stderr.flush()
    os._exit(0)


# --- the parent ------------------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child, before it runs: killed when this process dies (Linux ``PR_SET_PDEATHSIG``), so
    that a parent cut by an outer time limit leaves no child holding the GPU (its own session is out
    of reach of the signal that cut the parent)."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the timeout still kills it
        pass


def run_child(cmd: list[str], timeout: float, echo: bool = True, prefix: str = "    | ") -> tuple[Optional[dict], str, Optional[int], bool]:
    """Run ``cmd`` in its own process group, its output echoed as it comes; at ``timeout`` seconds
    the group is killed. Returns (the ROW it printed or None, its last lines, exit status, timed out)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                            start_new_session=True, errors="replace", preexec_fn=_die_with_parent)
    lines: list[str] = []
    found: list[dict] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(ROW):
                try:
                    found.append(json.loads(line[len(ROW):]))
                    continue
                except json.JSONDecodeError:
                    pass
            lines.append(line)
            del lines[:-200]
            if echo:
                print(prefix + line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        rc: Optional[int] = proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        rc = None
    try:  # the child's group (its compile workers too), also after a normal exit
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if timed_out:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    reader.join(timeout=10)
    return (found[-1] if found else None), "".join(lines[-30:]), rc, timed_out


class Runner:
    """Runs (configuration, batch) children: ``command(config, batch)`` the child's command line,
    ``timeout`` per child, ``deadline`` (a ``time.perf_counter()`` value, or None) after which no child
    starts and a child's timeout is cut to what is left; ``save()`` after each row."""

    def __init__(self, command: Callable[[str, int], list[str]], timeout: float, deadline: Optional[float],
                 save: Callable[[], None] = lambda: None, runner: Callable[..., tuple] = run_child) -> None:
        self.command, self.timeout, self.deadline, self.save, self.runner = command, timeout, deadline, save, runner

    def row(self, config: str, batch: int) -> dict:
        timeout = self.timeout
        if self.deadline is not None:
            left = self.deadline - time.perf_counter()
            if left < 20:
                print(f"  -- {config}, batch {batch}: skipped, --deadline reached", flush=True)
                return {"config": config, "batch": batch, "error": "skipped: --deadline reached", "skipped": True}
            timeout = min(timeout, left - 5)
        print(f"  -- {config}, batch {batch} (fresh process, limit {timeout:.0f} s)", flush=True)
        started = time.perf_counter()
        row, tail, rc, timed_out = self.runner(self.command(config, batch), timeout)
        if row is None:
            why = f"timed out after {timeout:.0f} s" if timed_out else f"the process exited with status {rc} and no row"
            row = {"config": config, "batch": batch, "error": why, "tail": tail[-2000:], "oom": "out of memory" in tail.lower()}
            if row["oom"]:
                row["error"] = "out of memory: " + why
        elif timed_out:
            row["note"] = f"killed after its row, at {timeout:.0f} s"
        if "ms" not in row and not row.get("error"):
            row["error"] = "the row has no step time"
        row["process_s"] = time.perf_counter() - started
        print("  " + summary(row), flush=True)
        return row


def summary(row: dict) -> str:
    head = f"{row['config']}, batch {row['batch']}:"
    if row.get("error"):
        return f"{head} {row['error']}" + (f" (peak reserved {row['peak_reserved_gib']:.2f} GiB)" if "peak_reserved_gib" in row else "")
    text = f"{head} {row['ms']:.2f} ms/step, {row['tokens_per_s'] / 1e3:.1f}k tok/s"
    if "peak_reserved_gib" in row:
        text += (f", peak allocated {row['peak_allocated_gib']:.2f} GiB, reserved {row['peak_reserved_gib']:.2f} GiB "
                 f"(steady: {row['end_reserved_gib']:.2f} reserved, device {row['device_used_gib']:.2f} used)")
    if row.get("alloc_retries"):
        text += f", {row['alloc_retries']} allocator retries"
    if row.get("captured") is False:
        text += f", NOT captured ({row.get('graph', '?')})"
    return text + f", first 4 steps {row.get('first_s', 0):.0f} s, loss {row.get('loss', float('nan')):.4f}"


def _ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:5.2f}x" if a is not None and b else "   - "


def memory_table(rows: list[dict]) -> str:
    """One line per row; the peaks' ratios to torch eager's at the same batch."""
    eager = {r["batch"]: r for r in rows if r["config"] == EAGER and not r.get("error")}
    out = [f"  {'config':40s} {'batch':>5s} {'ms/step':>8s} {'tok/s':>8s} {'tok/s/eager':>11s} {'peak alloc':>10s} {'peak res':>9s} "
           f"{'res/eager':>9s} {'alloc/eager':>11s} {'steady res':>10s}"]
    for r in rows:
        if r.get("error"):
            out.append(f"  {r['config']:40s} {r['batch']:5d}  {r['error'][:100]}")
            continue
        e = eager.get(r["batch"], {})
        res, alloc = r.get("peak_reserved_gib"), r.get("peak_allocated_gib")
        out.append(f"  {r['config']:40s} {r['batch']:5d} {r['ms']:8.2f} {r['tokens_per_s']:8.0f} "
                   f"{_ratio(r['tokens_per_s'], e.get('tokens_per_s')):>11s} "
                   + (f"{alloc:10.2f} {res:9.2f} {_ratio(res, e.get('peak_reserved_gib')):>9s} "
                      f"{_ratio(alloc, e.get('peak_allocated_gib')):>11s} {r['end_reserved_gib']:10.2f}" if res is not None else "")
                   + ("  NOT captured" if r.get("captured") is False else ""))
    return "\n".join(out)


def _device_of(results: dict, row: dict) -> None:
    """The device and torch version the children report, kept in ``results``."""
    if row.get("device") and "device" not in results:
        results["device"], results["child_torch"] = row["device"], row.get("torch")


def part_memory(results: dict, configs: list[str], batches: list[int], runner: Runner, describe: str) -> None:
    """Every configuration at every batch, each in a fresh process; the table (module docstring)."""
    print(f"\n== memory: {describe}; each (configuration, batch) in a fresh process, peaks over its whole life (GiB)")
    table = results.setdefault("memory", {})
    rows = []
    for batch in batches:
        for config in configs:
            row = runner.row(config, batch)
            rows.append(row)
            table[f"{config} b{batch}"] = row
            _device_of(results, row)
            runner.save()
    print(memory_table(rows))
    print(f"  on {results.get('device', '?')}, torch {results.get('child_torch', '?')}")


def part_largest(results: dict, plan: list[tuple[str, list[int]]], runner: Runner, describe: str) -> None:
    """Per configuration, its batches in increasing order until the first that does not run (out of
    memory, failure, timeout); the largest that ran, its tokens/s, and the ratio to torch eager's."""
    print(f"\n== largest batch: {describe}; each try in a fresh process")
    table = results.setdefault("largest", {})
    for config, batches in plan:
        tries, best = [], None
        for batch in batches:
            row = runner.row(config, batch)
            tries.append(row)
            _device_of(results, row)
            if row.get("error"):
                break
            best = row
        stop = tries[-1] if tries and tries[-1].get("error") else None
        table[config] = {"tries": tries, "largest": best["batch"] if best else None,
                         "tokens_per_s": best["tokens_per_s"] if best else None,
                         "peak_reserved_gib": best.get("peak_reserved_gib") if best else None,
                         "stopped_by": (stop["error"] if stop else f"none: every batch up to {batches[-1]} ran (a larger one may fit)")}
        runner.save()
    eager = table.get(EAGER, {})
    print(f"  {'config':40s} {'largest':>7s} {'tok/s':>8s} {'peak res':>9s} {'x eager batch':>13s} {'x eager tok/s':>13s}  stopped by")
    for config, _ in plan:
        t = table[config]
        if t["largest"] is None:
            print(f"  {config:40s} {'none':>7s} {'':8s} {'':9s} {'':13s} {'':13s}  {t['stopped_by'][:90]}")
            continue
        t["ratio_batch"] = t["largest"] / eager["largest"] if eager.get("largest") else None
        t["ratio_tokens_per_s"] = t["tokens_per_s"] / eager["tokens_per_s"] if eager.get("tokens_per_s") else None
        res = t["peak_reserved_gib"]
        print(f"  {config:40s} {t['largest']:7d} {t['tokens_per_s']:8.0f} {res if res is not None else float('nan'):9.2f} "
              f"{_ratio(t['largest'], eager.get('largest')):>13s} {_ratio(t['tokens_per_s'], eager.get('tokens_per_s')):>13s}  "
              f"{t['stopped_by'][:90]}")
    print(f"  on {results.get('device', '?')}, torch {results.get('child_torch', '?')}")
