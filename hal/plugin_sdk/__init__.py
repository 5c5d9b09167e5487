"""The plugin SDK: everything a backend needs from hal besides registering (:mod:`hal.plugin`), the
op declarations (``hal.ops``), the exceptions (``hal.errors``) and the annotations (``hal.types``).

A backend imports those, this package's submodules and the kits (``hal_torch``: every op in eager
PyTorch; ``hal_triton``, ``hal_cpp``), and nothing else of hal, so that the core may change behind
them; and no backend imports another (``tests/core/test_layers.py`` checks both, and that the layers
point one way: a backend or a kit may import the core, the core imports no backend and no kit, a
kit imports no backend). Code here needs no plugin and launches no kernel of its own. Some
submodules name what a backend uses of a core module (the module stays the core's; the SDK is the
part plugins rely on), the others hold vendor-neutral code that several backends, the kits and the
core itself share:

- :mod:`~hal.plugin_sdk.arrays`: hal's dtype names as torch's and NumPy's dtypes, a number rounded
  to float32, the memory-layout tests of torch's multi-tensor kernels (from :mod:`hal.arrays`);
- :mod:`~hal.plugin_sdk.kept`: what a forward kernel keeps for the backward kernel of the same
  call (from :mod:`hal.integration.kept`);
- :mod:`~hal.plugin_sdk.calls`: what a kernel or its check asks about its call: traced by
  torch.compile, needing autograd, its canonical arguments (from :mod:`hal.tracing` and
  :mod:`hal.dispatch`);
- :mod:`~hal.plugin_sdk.declarations`: the op declarations a registration reads (from
  :mod:`hal.registry`);
- :mod:`~hal.plugin_sdk.activations`: the PyTorch function of each activation name (the
  ``hal_torch`` kit's kernels, ``hal.nn``'s modules run unfused);
- :mod:`~hal.plugin_sdk.fold`: eval-mode batch norm folded into the preceding convolution, and
  the cache of folded parameters (``hal.nn.FusedConvBN2d`` and the backends' fused conv kernels);
- :mod:`~hal.plugin_sdk.fp8_hardware`: which FP8 formats a GPU's hardware has, and the capability
  check of kernels that refuse FP8 on a GPU without it (``hal.fp8`` layers, the eager emulation,
  the Triton and vendor FP8 kernels);
- :mod:`~hal.plugin_sdk.linear`: linear's gradients from the pre-activation's gradient rows, and
  the key of the gradients a ``linear_cross_entropy`` forward keeps for its backward.

Import the submodules themselves (``from hal.plugin_sdk.fold import FoldCache``): this package
imports none of them, so a backend pays only for what it uses.
"""
