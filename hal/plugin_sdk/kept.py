"""What a forward kernel keeps for the backward kernel of the same call (batch statistics, the
gradients of an LM head computed with its loss), so that the backward need not recompute them.

The store and the switch that arms it belong to hal's torch integration (:mod:`hal.integration.kept`,
where hal's autograd node arms the keeping around a forward kernel); this module names what a
kernel uses of it, so that backends and kits reach it through the plugin SDK:

- :class:`KeptForBackward`: a kernel's store of kept values, keyed by the input they describe;
- :func:`armed`: whether the forward running now runs for hal's autograd node (a backward op follows);
- :func:`backward_follows`: armed, and one of the given inputs takes gradients;
- :func:`param_state`: the identity and version of parameters, part of an entry's key.
"""

from __future__ import annotations

from hal.integration.kept import KeptForBackward, armed, backward_follows, param_state

__all__ = ["KeptForBackward", "armed", "backward_follows", "param_state"]
