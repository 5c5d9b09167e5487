"""The test models, written once against an ops namespace: ``hal.ops`` or :data:`TORCH` (the same
functions in plain PyTorch), so one class gives both the hal model and its PyTorch twin."""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

_ACT = {"none": lambda z: z, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def _fused_conv_bn_relu(x, w, b, gamma, beta, mean, var, stride=1, padding=0, dilation=1, groups=1, eps=1e-5, momentum=0.1, training=False):
    return F.relu(F.batch_norm(F.conv2d(x, w, b, stride, padding, dilation, groups), mean, var, gamma, beta, training, momentum, eps))


def _sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _rotary(x, cos, sin, interleaved=False):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _linear_cross_entropy(x, w, target, bias=None, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    return F.cross_entropy(F.linear(x, w, bias), target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)


#: the hal ops the models use, in plain PyTorch (same signatures).
TORCH = types.SimpleNamespace(
    conv2d=F.conv2d,
    batch_norm=F.batch_norm,
    fused_conv_bn_relu=_fused_conv_bn_relu,
    scale_shift_act=lambda x, scale=1.0, shift=0.0, act="relu": _ACT[act](x * scale + shift),
    linear=lambda x, w, b=None, act="none": _ACT[act](F.linear(x, w, b)),
    matmul=torch.matmul,
    layer_norm=F.layer_norm,
    rms_norm=F.rms_norm,
    softmax=lambda x, dim=-1: F.softmax(x, dim),
    scaled_dot_product_attention=_sdpa,
    rotary_embedding=_rotary,
    swiglu=lambda gate, up: F.silu(gate) * up,
    linear_cross_entropy=_linear_cross_entropy,
)


def _param(*shape: int, scale: float = 1.0, offset: float = 0.0) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) * scale + offset)


class SmallCNN(nn.Module):
    """conv-bn-relu (fused op), conv + batch_norm + residual add + relu, a linear head with an
    activation, then a plain linear."""

    def __init__(self, ops: Any, channels: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.ops = ops
        c = channels
        self.w1, self.g1, self.b1 = _param(c, 3, 3, 3, scale=0.3), _param(c, scale=0.1, offset=1.0), _param(c, scale=0.1)
        self.w2, self.cb2 = _param(c, c, 3, 3, scale=0.2), _param(c, scale=0.1)
        self.g2, self.b2 = _param(c, scale=0.1, offset=1.0), _param(c, scale=0.1)
        self.w3, self.b3 = _param(8, c, scale=0.5), _param(8, scale=0.1)
        self.w4, self.b4 = _param(classes, 8, scale=0.5), _param(classes, scale=0.1)
        for i in (1, 2):
            self.register_buffer(f"mean{i}", torch.randn(c) * 0.1)
            self.register_buffer(f"var{i}", torch.rand(c) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops, t = self.ops, self.training
        y = ops.fused_conv_bn_relu(x, self.w1, None, self.g1, self.b1, self.mean1, self.var1, 1, 1, 1, 1, 1e-5, 0.1, t)
        z = ops.conv2d(y, self.w2, self.cb2, 1, 1)
        z = ops.batch_norm(z, self.mean2, self.var2, self.g2, self.b2, t, 0.1, 1e-5)
        y = ops.scale_shift_act(z + y, 1.0, 0.0, "relu")
        h = ops.linear(y.mean(dim=(2, 3)), self.w3, self.b3, "relu")
        return ops.linear(h, self.w4, self.b4)


class TransformerBlock(nn.Module):
    """Pre-norm block: layer_norm, causal attention (linear q/k/v, sdpa, linear out), residual,
    layer_norm, linear+gelu MLP, residual; then attention pooling (matmul, softmax) and rms_norm."""

    def __init__(self, ops: Any, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.ops, self.heads = ops, heads
        d = dim
        self.ln1w, self.ln1b = _param(d, scale=0.1, offset=1.0), _param(d, scale=0.1)
        self.wqkv, self.bqkv = _param(3 * d, d, scale=d**-0.5), _param(3 * d, scale=0.1)
        self.wo, self.bo = _param(d, d, scale=d**-0.5), _param(d, scale=0.1)
        self.ln2w, self.ln2b = _param(d, scale=0.1, offset=1.0), _param(d, scale=0.1)
        self.w1, self.b1 = _param(2 * d, d, scale=d**-0.5), _param(2 * d, scale=0.1)
        self.w2, self.b2 = _param(d, 2 * d, scale=(2 * d) ** -0.5), _param(d, scale=0.1)
        self.wpool = _param(d, 1, scale=d**-0.5)
        self.rmsw = _param(d, scale=0.1, offset=1.0)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        ops = self.ops
        b, t, d = x.shape
        h = ops.layer_norm(x, (d,), self.ln1w, self.ln1b, 1e-5)
        q, k, v = ops.linear(h, self.wqkv, self.bqkv).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = ops.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), None, True, None)
        x = x + ops.linear(a.transpose(1, 2).reshape(b, t, d), self.wo, self.bo)
        h = ops.layer_norm(x, (d,), self.ln2w, self.ln2b, 1e-5)
        x = x + ops.linear(ops.linear(h, self.w1, self.b1, "gelu"), self.w2, self.b2)
        weights = ops.softmax(ops.matmul(x, self.wpool), 1)
        pooled = ops.matmul(weights.transpose(1, 2).contiguous(), x)
        return ops.rms_norm(pooled, (d,), self.rmsw, 1e-6)


class LlamaBlock(nn.Module):
    """A Llama-style decoder layer and its LM head with the loss: rms_norm, q/k/v projections,
    rotary embeddings on q and k, causal attention, residual, rms_norm, a SwiGLU MLP, residual, and
    linear_cross_entropy against next-token targets (the last row of each sequence ignored). Its
    input is token embeddings (B, T, D); its output the mean loss."""

    def __init__(self, ops: Any, dim: int = 8, heads: int = 2, vocab: int = 11) -> None:
        super().__init__()
        self.ops, self.heads = ops, heads
        d, hidden = dim, 3 * dim
        self.n1, self.n2, self.nf = (_param(d, scale=0.1, offset=1.0) for _ in range(3))
        self.wq, self.wk, self.wv, self.wo = (_param(d, d, scale=d**-0.5) for _ in range(4))
        self.wg, self.wu = _param(hidden, d, scale=d**-0.5), _param(hidden, d, scale=d**-0.5)
        self.wd = _param(d, hidden, scale=hidden**-0.5)
        self.head = _param(vocab, d, scale=d**-0.5)
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        b, t, d = x.shape
        hd = d // self.heads
        theta = torch.arange(t, dtype=x.dtype)[:, None] * 100.0 ** (-torch.arange(hd // 2, dtype=x.dtype) / (hd // 2))
        cos, sin = theta.cos(), theta.sin()
        h = ops.rms_norm(x, (d,), self.n1, 1e-6)
        q, k, v = (ops.linear(h, w).view(b, t, self.heads, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = ops.rotary_embedding(q, cos, sin), ops.rotary_embedding(k, cos, sin)
        a = ops.scaled_dot_product_attention(q, k, v, None, True, None)
        x = x + ops.linear(a.transpose(1, 2).reshape(b, t, d), self.wo)
        h = ops.rms_norm(x, (d,), self.n2, 1e-6)
        x = x + ops.linear(ops.swiglu(ops.linear(h, self.wg), ops.linear(h, self.wu)), self.wd)
        h = ops.rms_norm(x, (d,), self.nf, 1e-6)
        target = (torch.arange(b * t) * 7 % self.vocab).view(b, t)
        target[:, -1] = -100
        return ops.linear_cross_entropy(h.reshape(b * t, d), self.head, target.reshape(-1))


def twins(cls: type, seed: int, dtype: torch.dtype = torch.float64, **kwargs: Any) -> tuple[nn.Module, nn.Module]:
    """(hal model, PyTorch model) with identical parameters and buffers."""
    torch.manual_seed(seed)
    hal_model = cls(__import__("hal").ops, **kwargs).to(dtype)
    torch_model = cls(TORCH, **kwargs).to(dtype)
    torch_model.load_state_dict(hal_model.state_dict())
    return hal_model, torch_model


def randomize_batch_norms(model: nn.Module, mean_std: float = 0.2, bias_std: float = 0.5) -> nn.Module:
    """Give every BatchNorm2d of ``model`` a state that is not the identity (running mean ~ N(0,
    mean_std), running variance and weight in [0.5, 1.5], bias ~ N(0, bias_std)), drawn from torch's
    generator: folds and batch statistics then have something to get wrong. Returns the model."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, mean_std)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, bias_std)
    return model
