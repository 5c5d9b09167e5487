"""hal.fast: one call to make a training step fast.

    step = hal.optimize(model, optimizer, loss_fn=F.cross_entropy)
    for x, y in batches:
        loss = step(x, y)          # forward, loss, backward, optimizer step, zero_grad
    print(step.explain())          # what was done and why, with the measured times

- :mod:`hal.fast.plan`: the model's rewrite (``hal.nn.fuse``, else ``hal.nn.patch``) and the
  optimizer (``hal.optim.AdamW`` where it is the same update).
- :mod:`hal.fast.state`: what a step changes, saved and put back around the measurements.
- :mod:`hal.fast.step`: :class:`OptimizedStep`, the candidates (eager, ``torch.compile``, a
  whole-step CUDA graph, both) and the measurement that picks one.

(The package is not called ``hal.optimize``: importing a submodule of that name would replace the
function ``hal.optimize`` on the package.)
"""

from hal.fast.step import CANDIDATES, OptimizedStep, OptimizeReport, Trial, Variant, optimize

__all__ = ["optimize", "OptimizedStep", "OptimizeReport", "Trial", "Variant", "CANDIDATES"]
