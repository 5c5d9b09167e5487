"""hal.nn: modules computed by hal's fused ops, and the fusion pass that puts them into a model.

- :class:`FusedConvBNReLU2d`: conv -> batch-norm -> ReLU (state_dict of ``nn.Sequential(Conv2d,
  BatchNorm2d, ReLU)``); :class:`FusedConvBNAddReLU2d`: conv -> batch-norm -> add a residual ->
  ReLU, a ResNet block's tail (``forward(x, residual)``); :class:`FusedConvBN2d`: conv ->
  batch-norm (a downsample shortcut); :class:`Linear` with a fused activation;
  :class:`FusedLinearAct`, what :func:`fuse` puts beside a model's own ``nn.Linear`` followed by
  an activation; :class:`LayerNorm`, :class:`RMSNorm`.
- :func:`fuse`: a torch.fx pass replacing conv -> bn (-> add) -> relu, conv -> bn and linear ->
  activation chains.
- :func:`patch`: the same modules swapped in place by structure, without tracing (models torch.fx
  cannot trace, such as Hugging Face ``transformers`` models).
- :func:`recompute`: a model's repeated blocks recompute their activations in the backward
  (selectively or fully), for memory.
"""

from hal.nn.fuse import fuse
from hal.nn.modules import FusedConvBN2d, FusedConvBNAddReLU2d, FusedConvBNReLU2d, FusedLinearAct, LayerNorm, Linear, RMSNorm
from hal.nn.patch import patch
from hal.nn.recompute import recompute

__all__ = ["FusedConvBNReLU2d", "FusedConvBNAddReLU2d", "FusedConvBN2d", "FusedLinearAct", "Linear", "LayerNorm", "RMSNorm", "fuse", "patch", "recompute"]
