"""The ``hal`` command line (also ``python -m hal``): info, conformance, bench, tune, and ``--version``.

Output piped into a program that stops reading early (``hal info --json | head``) ends the command
quietly with status 141 (128 + SIGPIPE), as a command killed by SIGPIPE ends, instead of a
``BrokenPipeError`` traceback; Ctrl-C ends it with status 130 and one line. The other statuses are
:mod:`hal.cli.usage`'s: 0 success, 1 failures found, 2 a usage or environment problem (one line on
stderr saying what to do, never a traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

from hal.cli.usage import EXIT_INTERRUPTED, EXIT_USAGE, run_command

#: exit status after the reader of stdout went away (128 + SIGPIPE, what a shell shows for it).
EXIT_BROKEN_PIPE = 141

#: sub-command -> module with ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "info": ("hal.cli.info", "versions, plugins and their status, devices, op x backend coverage"),
    "conformance": ("hal.conformance.cli", "check every kernel of a backend against the reference"),
    "bench": ("hal.cli.bench", "time each op's chosen kernel against eager PyTorch and torch.compile"),
    "tune": ("hal.cli.tune", "measure the kernel choices of whole steps ahead of time, into this device's cache"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        status = _main(argv)
        sys.stdout.flush()  # a broken pipe shows here when the output was still buffered
        return status
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush cannot fail too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print("hal: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: Optional[Sequence[str]]) -> int:
    from hal.version import API_VERSION, __version__

    parser = argparse.ArgumentParser(prog="hal", description="hal: hardware abstraction layer for deep-learning ops")
    parser.add_argument("--version", action="version", version=f"hal {__version__} (plugin API {API_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    modules, parsers = {}, {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            p.set_defaults(_missing=f"'hal {name}' is not available in this installation: {exc}")
            continue
        module.add_arguments(p)
        modules[name] = module
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage, not hal's (argparse would show the top level's)
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    missing = getattr(args, "_missing", None)
    if missing:
        print(missing, file=sys.stderr)
        return EXIT_USAGE
    return run_command(f"hal {args.command}", modules[args.command].run, args)


if __name__ == "__main__":
    sys.exit(main())
