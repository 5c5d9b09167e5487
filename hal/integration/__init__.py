"""hal's integration with torch: what plugs hal's ops into autograd and torch.compile.

- :mod:`~hal.integration.autograd`: the eager autograd node of each trainable op (hal's ``node``
  route), generated from its declaration;
- :mod:`~hal.integration.library`: every op as ``torch.ops.hal.<name>`` with a fake kernel and an
  autograd formula, the nodes torch.compile records;
- :mod:`~hal.integration.compile`: what hal decides while torch.compile traces a call, what an
  opaque node runs, and torch.compile's caches keyed on hal's choices;
- :mod:`~hal.integration.kept`: what a forward kernel keeps for the backward kernel of the same call;
- :mod:`~hal.integration.errors`: hal's errors met while torch.compile traces, raised as hal errors.

The dispatcher does not import this package; importing it installs its hooks
(:data:`hal.dispatch.HOOKS`). ``import hal`` does.
"""

from __future__ import annotations

from . import autograd, compile, errors, kept, library

__all__ = ["autograd", "compile", "errors", "kept", "library"]
