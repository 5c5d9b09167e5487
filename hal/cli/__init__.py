"""The ``hal`` command line (also ``python -m hal``): info, conformance, bench."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

#: sub-command -> module with ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "info": ("hal.cli.info", "versions, plugins and their status, devices, op x backend coverage"),
    "conformance": ("hal.conformance.cli", "check every kernel of a backend against the reference"),
    "bench": ("hal.cli.bench", "time each op's chosen kernel against eager PyTorch and torch.compile"),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="hal", description="hal: hardware abstraction layer for deep-learning ops")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            p.set_defaults(_missing=f"'hal {name}' is not available in this installation: {exc}")
            continue
        module.add_arguments(p)
        modules[name] = module
    args = parser.parse_args(argv)
    missing = getattr(args, "_missing", None)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
