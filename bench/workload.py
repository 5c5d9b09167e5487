"""The protocol of the whole-model benchmark (:mod:`hal_bench.models`): a :class:`Workload` builds a
model's step for one implementation; a :class:`Variant` is one column of the table. The workloads
(``models_resnet``, ``models_llama``, ``models_hf``, ``models_moe``, ``models_big``) build on this
module, the harness runs them.

The columns (issue 28): the peers eager, ``compile`` (torch.compile's default mode), ``compile
reduce-overhead`` (torch.compile's CUDA-graph mode: Inductor's cudagraph trees over the model, the
optimizer step eager), ``compile+graph`` (the default-mode compiled model's whole training step, the
optimizer included, captured once with ``hal.graphs.graphed`` and replayed), ``eager+graph`` and
Liger-Kernel where it applies (and ``liger+compile``, its patched model under torch.compile, on the
Hugging Face rows); hal's steps ``hal``, ``hal+compile``, ``hal+graph`` and
``hal+compile+graph``. The ``+graph`` variants run only on a CUDA device."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from .flops import FlopCount

#: the size presets of every workload
SIZES = ("full", "cpu", "tiny")

#: steps of the loss trajectory (the first ones compile; none of them is timed)
TRAJECTORY_STEPS = 20


@dataclasses.dataclass
class Step:
    """One step of a workload: ``step()`` runs it and returns its loss (training, forward +
    backward) or output (inference); ``model`` is the module it trains or runs (for the tests)."""

    run: Callable[[], torch.Tensor]
    model: nn.Module
    #: the optimizer a training step updates (the harness makes it capturable for the graph variants)
    optimizer: Optional[torch.optim.Optimizer] = None

    def __call__(self) -> torch.Tensor:
        return self.run()


class NotApplicable(Exception):
    """A variant that this workload cannot run here (the reason goes into the table)."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One column of the table: an implementation of the model, optionally under torch.compile."""

    name: str
    impl: str  # "torch", "hal", "liger" or a workload's own peer
    compile_mode: Optional[str] = None  # None: not compiled; "default" or a torch.compile mode
    graph: bool = False  # the whole step captured once and replayed (hal.graphs), CUDA only
    fp8: bool = False  # GEMMs in FP8 (issue 40's FP8 targets): kept out of the bf16 comparisons


EAGER = Variant("eager", "torch")
COMPILE = Variant("compile", "torch", "default")
COMPILE_MAX_AUTOTUNE = Variant("compile max-autotune", "torch", "max-autotune-no-cudagraphs")
HAL = Variant("hal", "hal")
HAL_COMPILE = Variant("hal+compile", "hal", "default")
LIGER = Variant("liger", "liger")
#: Liger-Kernel's patched model under torch.compile (default mode), the model and its loss together
LIGER_COMPILE = Variant("liger+compile", "liger", "default")
#: the whole step as one CUDA graph (``hal.graphs.graphed``): torch's own step, hal's, and each of
#: them over the model compiled by torch.compile in its default mode (the optimizer step inside the
#: graph too)
EAGER_GRAPH = Variant("eager+graph", "torch", graph=True)
HAL_GRAPH = Variant("hal+graph", "hal", graph=True)
COMPILE_GRAPH = Variant("compile+graph", "torch", "default", graph=True)
HAL_COMPILE_GRAPH = Variant("hal+compile+graph", "hal", "default", graph=True)
#: torch.compile's own CUDA-graph mode (Inductor's cudagraph trees over the compiled model; the
#: optimizer step stays eager there, outside any graph)
COMPILE_REDUCE_OVERHEAD = Variant("compile reduce-overhead", "torch", "reduce-overhead")
#: the one-call step, ``hal.optimize(model, optimizer)``: hal picks rewrite, compile and graph itself
#: by measuring them on its first call (a workload offers it where its step fits that call)
HAL_OPTIMIZE = Variant("hal.optimize", "hal.optimize")
#: FP8 (issue 40): hal.optimize with hal's FP8 layers (``fp8=hal.fp8.CurrentScaling()``), and
#: torchao.float8's tensorwise and rowwise recipes under torch.compile (tensorwise also captured
#: whole); their row's comparison is FP8 hal against the best bf16 peer and the best torchao
HAL_OPTIMIZE_FP8 = Variant("hal.optimize fp8", "hal.optimize fp8", fp8=True)
TORCHAO_TENSORWISE_COMPILE = Variant("torchao tensorwise+compile", "torchao tensorwise", "default", fp8=True)
TORCHAO_ROWWISE_COMPILE = Variant("torchao rowwise+compile", "torchao rowwise", "default", fp8=True)
TORCHAO_TENSORWISE_COMPILE_GRAPH = Variant("torchao tensorwise+compile+graph", "torchao tensorwise", "default", graph=True, fp8=True)
FP8_VARIANTS = (HAL_OPTIMIZE_FP8, TORCHAO_TENSORWISE_COMPILE, TORCHAO_ROWWISE_COMPILE, TORCHAO_TENSORWISE_COMPILE_GRAPH)
#: hal's steps (the "best hal" of a row is the fastest of these)
HAL_VARIANTS = (HAL.name, HAL_COMPILE.name, HAL_GRAPH.name, HAL_COMPILE_GRAPH.name, HAL_OPTIMIZE.name)


class Workload(abc.ABC):
    """One model and one kind of step (training, inference, forward + backward)."""

    #: short name used on the command line
    name: str = ""
    #: "train", "infer" or "fwd_bwd"
    kind: str = "train"
    #: what the throughput counts ("images", "tokens")
    unit: str = "items"

    def __init__(self, size: str = "full") -> None:
        if size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, not {size!r}")
        self.size = size

    @abc.abstractmethod
    def describe(self) -> str:
        """The row label: model, step, dtype, layout, batch."""

    @abc.abstractmethod
    def items_per_step(self) -> int:
        """Images or tokens processed by one step."""

    @abc.abstractmethod
    def make(self, impl: str, compile_mode: Optional[str], device: torch.device, seed: int) -> Step:
        """The step closure of implementation ``impl`` (model built from ``seed``; data from
        ``seed + 1``, identical for every implementation). Raises :class:`NotApplicable`."""

    def extra_variants(self) -> list[Variant]:
        """Peers of this workload only (for example torch's grouped GEMM for the MoE layer)."""
        return []

    def flops_per_step(self) -> Optional[FlopCount]:
        """The model flops of one step (:mod:`hal_bench.flops`), for MFU; None where not counted."""
        return None

    def with_batch(self, batch: int) -> "Workload":
        """This workload at another batch size (the largest-batch search); NotApplicable by default."""
        raise NotApplicable(f"{self.name} has no batch size to vary")

    def reference(self, device: torch.device, seed: int) -> Optional[torch.Tensor]:
        """Inference: the output of the eager model in float32 on the same input (None otherwise)."""
        return None

    def variants(self, use_compile: bool, max_autotune: bool, graphs: bool = False) -> list[Variant]:
        """The columns of this workload's row, in table order (``graphs``: with the CUDA-graph
        variants, on a GPU)."""
        out = [EAGER]
        if use_compile:
            out.append(COMPILE)
            if max_autotune and self.kind == "infer":
                out.append(COMPILE_MAX_AUTOTUNE)
        out.append(HAL)
        if use_compile:
            out.append(HAL_COMPILE)
        out.append(LIGER)
        if graphs:
            out.append(EAGER_GRAPH)
            if use_compile:
                out += [COMPILE_REDUCE_OVERHEAD, COMPILE_GRAPH]
            out.append(HAL_GRAPH)
            if use_compile:
                out.append(HAL_COMPILE_GRAPH)
        return out + [v for v in self.extra_variants() if (graphs or not v.graph) and (use_compile or v.compile_mode is None)]


def compiled(module: nn.Module, mode: Optional[str]) -> Callable[..., Any]:
    """``module`` itself, or torch.compile of it in ``mode`` ("default": torch.compile's default)."""
    if mode is None:
        return module
    return torch.compile(module, mode=None if mode == "default" else mode)


def data_generator(seed: int) -> torch.Generator:
    """The CPU generator the data of every implementation is drawn from (``seed + 1``)."""
    return torch.Generator().manual_seed(seed + 1)
