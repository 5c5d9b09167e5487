"""``hal.dist.comm_hook``: hal's all-reduce as a DistributedDataParallel communication hook.

DDP groups gradients into buckets (``bucket_cap_mb``) and calls the hook with each bucket as soon
as its gradients are ready, while backward goes on; the hook starts the all-reduce asynchronously
and returns a future, which DDP waits for only at the end of backward. This hook starts
``hal.dist.all_reduce(bucket, op="avg", algorithm=..., async_op=True)``: the average DDP expects,
with the algorithm of your choice (``compressed_fp16`` halves the bytes sent).
"""

# No ``from __future__ import annotations`` here: DDP compares the hook's annotations with the real
# classes (dist.GradBucket, torch.futures.Future[torch.Tensor]).

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hal.dist.algorithms import REGISTRY
from hal.dist.collectives import all_reduce
from hal.errors import InvalidArgumentError


def comm_hook(algorithm: str = "auto") -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """A hook for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    ``state`` is the process group to reduce over (None: the default group, as with torch's own
    hooks; pass DDP's ``process_group`` when it was built with another). Example::

        model = DistributedDataParallel(net)
        model.register_comm_hook(None, hal.dist.comm_hook("compressed_fp16"))
    """
    if algorithm != "auto" and algorithm not in REGISTRY["all_reduce"]:
        names = ", ".join(["auto", *REGISTRY["all_reduce"]])
        raise InvalidArgumentError("hal.dist.comm_hook", "algorithm", f"one of {names}", repr(algorithm))

    def hook(state: Optional[Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        group = state if isinstance(state, dist.ProcessGroup) else None
        return all_reduce(bucket.buffer(), op="avg", group=group, algorithm=algorithm, async_op=True).get_future()

    hook.__name__ = hook.__qualname__ = f"hal_{algorithm}_hook"
    return hook
