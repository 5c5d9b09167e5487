"""Known failures: one file per backend, ``conformance/xfail/<backend>.txt``, listing exact case ids.

Each line holds a case id, whitespace, and the reason (required: a known failure without a reason
is a failure nobody will come back to). ``#`` starts a comment::

    # cuDNN's implicit-GEMM conv flushes fp16 subnormal inputs to zero
    conv2d[cudnn,float16,fp16_underflow]  subnormal inputs flushed to zero (cudnn 9.19)

A listed case that fails (or errors) is ``xfail``; one that passes is ``xpass`` (the entry is out of
date). An id that matches no case of the backend is stale: the runner warns about it, since a
renamed case would otherwise silently lose its entry.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Union

from .cases import parse_case_id

XFAIL_DIR = Path(__file__).with_name("xfail")


@dataclasses.dataclass
class XfailList:
    """Known failures of one backend: case id -> reason, and where they came from."""

    entries: dict[str, str] = dataclasses.field(default_factory=dict)
    sources: list[str] = dataclasses.field(default_factory=list)

    def reason(self, case_id: str) -> Optional[str]:
        return self.entries.get(case_id)


def parse(text: str, source: str) -> dict[str, str]:
    """id -> reason from the text of an xfail file; malformed lines raise ValueError with their place."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        parts = body.split(None, 1)
        if parse_case_id(parts[0]) is None:
            raise ValueError(f"{source}:{n}: {parts[0]!r} is not a case id (op[kernel,dtype,case])")
        if len(parts) < 2:
            raise ValueError(f"{source}:{n}: {parts[0]} has no reason; write why it is expected to fail after the id")
        out[parts[0]] = parts[1].strip()
    return out


def check_given_file(path: Path, what: str, option: str) -> None:
    """Raise FileNotFoundError, saying which, where ``path`` (given with ``option``, a ``what`` such
    as "xfail file") is a folder or does not exist."""
    if path.is_dir():
        raise FileNotFoundError(f"{what} {path} is a folder, not a file (given with {option}): give the path of the file itself")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist (given with {option})")


def load(backend: str, extra_file: Union[None, str, Path] = None) -> XfailList:
    """The xfail list of ``backend``: this package's file for it, plus ``extra_file`` if given."""
    xs = XfailList()
    if extra_file:
        check_given_file(Path(extra_file), "xfail file", "--xfail")
    for path in (XFAIL_DIR / f"{backend}.txt", Path(extra_file) if extra_file else None):
        if path is None or not path.is_file():
            continue
        xs.entries.update(parse(path.read_text(), str(path)))
        xs.sources.append(str(path))
    return xs
