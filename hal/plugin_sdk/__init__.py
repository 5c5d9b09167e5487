"""The plugin SDK's shared helpers: vendor-neutral code that several backends, the kernel kits
(``hal_triton``, ``hal_cpp``) and the core itself use.

Backends declare themselves and register kernels with :mod:`hal.plugin`; what they share beyond
that lives here, in the core, because the layers point one way: a backend or a kit may import the
core, the core imports no backend and no kit, a kit imports no backend, and no backend imports
another (``tests/core/test_layers.py`` checks all of it). Code here needs no plugin and launches
no kernel of its own:

- :mod:`~hal.plugin_sdk.activations`: the PyTorch function of each activation name (the eager
  backend's kernels, ``hal.nn``'s modules run unfused);
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
