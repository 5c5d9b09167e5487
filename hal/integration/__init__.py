"""hal's integration with torch: what plugs hal's ops into autograd and torch.compile.

- :mod:`~hal.integration.autograd`: the eager autograd node of each trainable op (hal's ``node``
  route), generated from its declaration;
- :mod:`~hal.integration.library`: every op as ``torch.ops.hal.<name>`` with a fake kernel and an
  autograd formula, the nodes torch.compile records;
- :mod:`~hal.integration.compile`: what hal decides while torch.compile traces a call, what an
  opaque node runs, and torch.compile's caches keyed on hal's choices;
- :mod:`~hal.integration.kept`: what a forward kernel keeps for the backward kernel of the same call;
- :mod:`~hal.integration.errors`: hal's errors met while torch.compile traces, raised as hal errors.

The dispatcher does not import this package, and importing it changes nothing:
:func:`hal.wiring.wire` connects its functions to the dispatcher (:class:`hal.dispatch.Integration`)
and registers every op with torch (:func:`~hal.integration.library.register_op`) when ``import
hal`` runs.
"""

from __future__ import annotations

from . import autograd, compile, errors, kept, library

__all__ = ["autograd", "compile", "errors", "kept", "library"]
