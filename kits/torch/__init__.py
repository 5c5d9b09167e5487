"""hal_torch: every op of the registry written in eager PyTorch, a kit every backend may import.

These functions are the peers of hal's kernels: the ``eager`` backend registers all of them as its
kernels (the reference cpu_ref is checked against, the eager baseline of ``hal bench``); the cpu
backend registers those that are torch's CPU kernels (oneDNN, MKL) and builds its fused kernels on
them; the cuda and rocm backends register them as the kernels of torch's own GPU libraries (cuDNN,
cuBLAS, MIOpen, hipBLASLt) and as fallbacks. They used to live in the eager backend, which the other
backends then imported; a kit beside the core (shipped in the core distribution, as ``hal_triton``
and ``hal_cpp`` are) keeps every backend independent of the others.

Each function has its op's parameters, in order, and receives canonical arguments (as kernels do:
stride as a pair, padding as (top, bottom, left, right), dim >= 0, eps resolved ...), torch tensors
in and out, on any torch device; in-place ops mutate in place as the op does. Backward ops are
computed with torch.autograd through the forward, or with torch's own backward kernels.

One module per op family, each listing its ops' functions in ``__all__`` under the op's name and
the capability checks some of them need in ``CHECKS``; beside them the helpers backends build on
(half precision in float32 for fused convolutions, batch statistics kept for the backward, ...).
:mod:`hal_torch.table` gathers every op's function and check. This package imports none of its
modules: import them themselves (``from hal_torch import conv``).
"""
