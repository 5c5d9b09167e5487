"""ResNet workloads: a training step (bf16 autocast, channels_last, AdamW) and inference (fp16 or
bf16 weights, channels_last).

At size ``full`` the model is torchvision's ResNet-50 where torchvision imports (the device machine);
elsewhere, and at the small sizes, :class:`ResNet` below, built here with the same structure
(bottleneck blocks, one ReLU module per block called three times, downsample as an
``nn.Sequential(conv, bn)``): torchvision does not import beside the CPU build of torch in CI.

hal's variant is ``hal.nn.fuse(model)`` (conv -> batch-norm -> ReLU chains become
``hal.nn.FusedConvBNReLU2d``) and ``hal.optim.AdamW``. With bfloat16 autocast no loss scaling is
needed, so ``hal.amp`` has no part here. The peers use ``torch.optim.AdamW(fused=True)``, torch's
fastest AdamW. Liger-Kernel has no kernels for convolutional networks.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .workload import NotApplicable, Step, Workload, compiled, data_generator


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, ...]
    width: int  # channels of the stem and of the first stage's bottleneck
    classes: int
    batch: int
    image: int  # height = width of the input


CONFIGS = {
    "full": ResNetConfig(layers=(3, 4, 6, 3), width=64, classes=1000, batch=64, image=224),
    "cpu": ResNetConfig(layers=(1, 1, 1, 1), width=16, classes=100, batch=16, image=64),
    "tiny": ResNetConfig(layers=(1, 1), width=4, classes=5, batch=3, image=16),
}


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride here) -> 1x1 expanding by 4, batch norm after each, identity or projection
    shortcut, ReLU after the sum (torchvision's ResNet v1.5 block)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet(nn.Module):
    """Stem (7x7 stride 2, max-pool), stages of bottleneck blocks doubling the width and halving the
    resolution, global average pool, linear classifier."""

    def __init__(self, layers: tuple[int, ...], width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes, stages = width, []
        for i, blocks in enumerate(layers):
            planes, stride = width * 2**i, 1 if i == 0 else 2
            down = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False), nn.BatchNorm2d(planes * 4))
            stage = [Bottleneck(inplanes, planes, stride, down)] + [Bottleneck(planes * 4, planes) for _ in range(blocks - 1)]
            stages.append(nn.Sequential(*stage))
            inplanes = planes * 4
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.avgpool(self.layers(x))
        return self.fc(torch.flatten(x, 1))


def _torchvision_resnet50() -> Optional[Callable[..., nn.Module]]:
    """torchvision's resnet50 builder, None where torchvision is missing or does not import."""
    try:
        from torchvision.models import resnet50
    except Exception:  # noqa: BLE001 - any import failure (torchvision built for another torch)
        return None
    return resnet50


def build_resnet(cfg: ResNetConfig, size: str) -> nn.Module:
    """torchvision's ResNet-50 at size full where it imports, else :class:`ResNet`."""
    tv = _torchvision_resnet50() if size == "full" else None
    return tv(num_classes=cfg.classes) if tv is not None else ResNet(cfg.layers, cfg.width, cfg.classes)


def _hal_fuse(model: nn.Module) -> nn.Module:
    import hal

    return hal.nn.fuse(model, inplace=True)


def _images(cfg: ResNetConfig, seed: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=data_generator(seed))
    return x.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)


class ResNetTrain(Workload):
    """Training step: forward under autocast (bfloat16 on a GPU, float32 at size tiny), cross-entropy,
    backward, AdamW step, gradients set to None."""

    name = "resnet50_train"
    kind = "train"
    unit = "images"

    def __init__(self, size: str = "full", amp_dtype: Optional[torch.dtype] = torch.bfloat16, lr: float = 1e-3, eps: float = 1e-8) -> None:
        super().__init__(size)
        self.cfg = CONFIGS[size]
        self.amp_dtype = None if size == "tiny" else amp_dtype
        self.lr, self.eps = lr, eps

    def describe(self) -> str:
        amp = f"{str(self.amp_dtype).removeprefix('torch.')} autocast" if self.amp_dtype else "float32"
        return f"{_model_name(self.cfg, self.size)} training step, {amp}, channels_last, batch {self.cfg.batch}, AdamW"

    def items_per_step(self) -> int:
        return self.cfg.batch

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        if impl not in ("torch", "hal"):
            raise NotApplicable("Liger-Kernel has no kernels for convolutional networks" if impl == "liger" else f"no {impl} variant")
        torch.manual_seed(seed)
        model = build_resnet(self.cfg, self.size)
        model = model.to(device).to(memory_format=torch.channels_last).train()
        if impl == "hal":
            import hal

            model = _hal_fuse(model)
            opt: torch.optim.Optimizer = hal.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=self.lr, eps=self.eps, fused=True)
        x = _images(self.cfg, seed, device)
        y = torch.randint(0, self.cfg.classes, (self.cfg.batch,), generator=data_generator(seed + 1)).to(device)
        forward, amp = compiled(model, compile_mode), self.amp_dtype

        def step() -> torch.Tensor:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss = F.cross_entropy(forward(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return Step(step, model, opt)


class ResNetInference(Workload):
    """Inference: the model's weights and input in ``dtype`` (float32 at size tiny), eval mode,
    ``torch.inference_mode``; the output is the logits."""

    kind = "infer"
    unit = "images"

    def __init__(self, size: str = "full", dtype: torch.dtype = torch.float16) -> None:
        super().__init__(size)
        self.cfg = CONFIGS[size]
        self.dtype = torch.float32 if size == "tiny" else dtype
        self.name = "resnet50_infer_" + {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def describe(self) -> str:
        return f"{_model_name(self.cfg, self.size)} inference, {str(self.dtype).removeprefix('torch.')}, channels_last, batch {self.cfg.batch}"

    def items_per_step(self) -> int:
        return self.cfg.batch

    def _model(self, device: torch.device, seed: int, dtype: torch.dtype) -> nn.Module:
        torch.manual_seed(seed)
        model = build_resnet(self.cfg, self.size)
        _randomise_statistics(model, seed)
        return model.to(device=device, dtype=dtype).to(memory_format=torch.channels_last).eval()

    def reference(self, device: torch.device, seed: int) -> torch.Tensor:
        model = self._model(device, seed, torch.float32)
        with torch.inference_mode():
            return model(_images(self.cfg, seed, device)).float()

    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        if impl not in ("torch", "hal"):
            raise NotApplicable("Liger-Kernel has no kernels for convolutional networks" if impl == "liger" else f"no {impl} variant")
        model = self._model(device, seed, self.dtype)
        if impl == "hal":
            model = _hal_fuse(model)
        forward = compiled(model, compile_mode)
        x = _images(self.cfg, seed, device, self.dtype)

        def step() -> torch.Tensor:
            with torch.inference_mode():
                return forward(x)

        return Step(step, model)


def _randomise_statistics(model: nn.Module, seed: int) -> None:
    """Running statistics and affine parameters away from their initial 0/1 (an untrained network's
    batch norms are identities in eval, which would hide a wrong fold)."""
    gen = torch.Generator().manual_seed(seed + 2)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(c, generator=gen) * 0.5 + 0.75)
                m.bias.copy_(torch.randn(c, generator=gen) * 0.1)


def _model_name(cfg: ResNetConfig, size: str) -> str:
    if size != "full":
        return f"ResNet{list(cfg.layers)} width {cfg.width} ({cfg.image}x{cfg.image})"
    return "torchvision ResNet-50" if _torchvision_resnet50() is not None else "ResNet-50 (built in hal_bench, torchvision not importable)"
