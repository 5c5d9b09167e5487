"""The options of ``hal bench --collectives`` (declared by :mod:`hal.dist.bench`) checked before any
rank starts: a size range that never ends (``--step-factor 1``, ``--min-bytes 0``), a count below
one, or an unknown collective, algorithm, device or dtype would otherwise hang, end in a traceback
from a rank, or run nothing."""

from __future__ import annotations

import argparse

import torch

from hal.cli.usage import CommandLineError, unknown


def _problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the collectives options, each saying what to give instead."""
    from hal.dist import algorithms
    from hal.dist.bench import COLLECTIVES

    out = [f"--{name.replace('_', '-')} {getattr(args, name)}: give {low} or more"
           for name, low in (("world_size", 1), ("min_bytes", 1), ("batches", 1), ("threads", 1), ("iters", 0), ("ranks_per_node", 0))
           if getattr(args, name) < low]
    if args.max_bytes < args.min_bytes:
        out.append(f"--max-bytes {args.max_bytes}: give at least --min-bytes ({args.min_bytes})")
    if not args.step_factor > 1:  # NaN too: the sizes would never grow
        out.append(f"--step-factor {args.step_factor}: give a factor above 1")
    if args.device not in ("cpu", "cuda"):
        out.append(f"--device {args.device}: give cpu (gloo) or cuda (NCCL/RCCL)")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        out.append(f"--dtype {args.dtype}: give a torch dtype name such as float32 or bfloat16")
    collectives = [c.strip() for c in args.collective_ops.split(",") if c.strip()]
    for option, given, known in (("--collective-ops", collectives, COLLECTIVES),
                                 ("--algorithms", [a.strip() for a in args.algorithms.split(",") if a.strip()], algorithms("all_reduce"))):
        problem = unknown(option.removeprefix("--").rstrip("s").replace("-", " "), given, known)
        if problem:
            out.append(f"{option}: {problem}")
    if not collectives:
        out.append(f"--collective-ops {args.collective_ops!r} names nothing: give one or more of {', '.join(COLLECTIVES)}")
    return out


def check(args: argparse.Namespace) -> None:
    """Raise :class:`CommandLineError` listing every bad collectives option."""
    problems = _problems(args)
    if problems:
        raise CommandLineError("; ".join(problems))
