"""Whether torch.compile is tracing a call: the one place hal decides it.

Two tracers see a model's calls. Dynamo runs the Python code and answers
``torch.compiler.is_compiling()`` with True in every torch version. AOTAutograd then traces the
graph Dynamo recorded, on fake tensors (functional tensors wrapping fake ones); there
``is_compiling()`` says True from torch 2.13 on, but False in 2.11 and 2.12, so a hal op called
inside a decomposition that AOTAutograd traces (a training decomposition's steps) cannot rely on
it. hal asks both: :func:`is_compiling` on the hot path (a C call), and :func:`traced` of the
arguments where a call misses the dispatcher's cache, which fake and functional tensors always do
(their type is part of the cache key). A traced call never runs a kernel on fake tensors and
never measures anything.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

#: Dynamo is tracing the running code (True in every torch version while Dynamo runs it).
is_compiling = torch.compiler.is_compiling


def traced(args: Sequence[Any]) -> bool:
    """Whether ``args`` are being traced rather than computed: Dynamo shows a call fake tensors,
    AOTAutograd, which builds the graph Inductor compiles, functional tensors wrapping fake ones.
    Lists of arrays are looked into. Real tensors answer at the cost of one isinstance test each."""
    for a in args:
        if isinstance(a, FakeTensor):
            return True
        if isinstance(a, FunctionalTensor):  # eager torch.func.functionalize wraps real tensors
            return isinstance(torch._from_functional_tensor(a.elem), FakeTensor)
        if isinstance(a, (list, tuple)) and a and traced(a):
            return True
    return False


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (nothing may be measured or
    synchronised then). False where CUDA was never initialised."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
