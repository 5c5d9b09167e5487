"""Train a small residual CNN on synthetic data with hal's fused kernels, mixed precision and AdamW.

    python examples/train_cnn.py                 # 200 steps, bfloat16 autocast
    python examples/train_cnn.py --steps 20 --dtype float16 --master-weights

The model is written in plain PyTorch (Conv2d -> BatchNorm2d -> ReLU blocks, ResNet-style residual
blocks reusing ``self.relu``, a Linear -> GELU head); ``hal.nn.fuse`` turns its chains into
``FusedConvBNReLU2d``, ``FusedConvBNAddReLU2d`` (each block's conv -> bn -> add -> ReLU tail) and
``hal.nn.Linear(act="gelu")`` modules. It trains under ``torch.autocast``
with ``hal.amp.DynamicLossScaler`` and ``hal.optim.AdamW`` (``--master-weights``: the parameters
themselves are half precision and AdamW keeps float32 masters). The data are images whose class is
the quadrant holding a bright blob, plus noise. At the end it evaluates on fresh images (eval mode:
the fused kernels run; in training the fused ops take their training decomposition, see
hal.integration.library), then prints which kernel the dispatcher chose for every op it ran
(``hal.stats()``) and the loss scaler's history.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import hal
import hal.amp
import hal.nn
import hal.optim

CLASSES = 4


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (one ReLU module used twice)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + x)


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block1 = BasicBlock(width)
        self.down = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU())
        self.block2 = BasicBlock(2 * width)
        self.fc1 = nn.Linear(2 * width, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block2(self.down(self.block1(self.stem(x))))
        return self.fc2(self.act(self.fc1(y.mean(dim=(2, 3)))))


def synthetic_batch(batch: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images whose label is the quadrant (0-3) holding a bright blob."""
    labels = torch.randint(0, CLASSES, (batch,), generator=generator)
    images = 0.5 * torch.randn(batch, 3, size, size, generator=generator)
    half = size // 2
    for i, label in enumerate(labels.tolist()):
        r, c = divmod(label, 2)
        images[i, :, r * half : (r + 1) * half, c * half : (c + 1) * half] += 1.0
    return images, labels


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=16, help="image height and width")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16", help="autocast dtype")
    parser.add_argument("--master-weights", action="store_true", help="half-precision parameters with float32 masters in AdamW")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    device_type = torch.device(args.device).type
    model = hal.nn.fuse(SmallCNN()).to(args.device)
    if args.master_weights:
        model = model.to(dtype)
    fused = [f"{name} ({type(m).__name__})" for name, m in model.named_modules() if isinstance(m, (hal.nn.FusedConvBNReLU2d, hal.nn.FusedConvBNAddReLU2d, hal.nn.FusedLinearAct, hal.nn.Linear))]
    print("hal.nn.fuse replaced: " + ", ".join(fused) + "\n")
    optimizer = hal.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4, master_weights=args.master_weights)
    scaler = hal.amp.DynamicLossScaler(init_scale=2.0**12, growth_interval=50, policy=hal.amp.ScalerPolicy(stats_every=args.log_every))
    hal.reset_stats()

    loss_value, start = float("nan"), time.perf_counter()
    for step in range(1, args.steps + 1):
        images, labels = synthetic_batch(args.batch, args.size, gen)
        images, labels = images.to(args.device), labels.to(args.device)
        with torch.autocast(device_type=device_type, dtype=dtype):
            logits = model(images)
            loss = F.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_value = loss.item()
        if step % args.log_every == 0 or step == args.steps:
            accuracy = float((logits.argmax(dim=1) == labels).float().mean())
            print(f"step {step:4d}  loss {loss_value:.4f}  batch accuracy {accuracy:.2f}  scale {scaler.get_scale():g}  ({time.perf_counter() - start:.1f} s)")

    model.eval()  # inference: batch norm with running statistics, the fused kernels without autograd
    images, labels = synthetic_batch(4 * args.batch, args.size, gen)
    with torch.no_grad(), torch.autocast(device_type=device_type, dtype=dtype):
        accuracy = float((model(images.to(args.device)).argmax(dim=1) == labels.to(args.device)).float().mean())
    print(f"eval accuracy on {4 * args.batch} fresh images: {accuracy:.2f}")

    print("\nkernels chosen by the dispatcher (op, backend, kernel: calls, fallbacks):")
    for (op, backend, kernel), counts in sorted(hal.stats().items()):
        if counts["calls"]:
            print(f"  {op:30s} {backend}/{kernel:12s} calls {counts['calls']:6d}  fallbacks {counts['fallbacks']}")
    print(f"\nloss scaler: {scaler.history}")
    for s in scaler.history.grad_stats[-3:]:
        print(f"  step {s.step}: grad norm {s.norm:.4f}, max |g| {s.max_abs:.4f}, zeros {100 * s.zero_fraction:.2f}%")
    return loss_value


if __name__ == "__main__":
    main()
