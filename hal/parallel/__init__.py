"""hal.parallel: distributed operators on torch.distributed device meshes, proven against one device.

Tensor and sequence parallelism, vocabulary parallelism, expert parallelism and pipeline stages,
built on ``DeviceMesh`` / ``DTensor`` and ``torch.distributed.pipelining``. hal adds its fused
kernels inside each rank's share of the work, and every collective these layers issue goes through
:mod:`hal.dist` (algorithm choice, ``hal.explain``, :class:`hal.dist.CommError` on a dead or
stalled peer).
"""

from __future__ import annotations

__all__: list[str] = []

# tensor and sequence parallelism, the plan that applies them, their cost on paper (tensor.py, plan.py, cost.py)
from hal.parallel.tensor import (  # noqa: E402
    ColumnParallelLinear, ParallelAttention, ParallelLayerNorm, ParallelMLP, ParallelRMSNorm, RowParallelLinear,
)
from hal.parallel.plan import (  # noqa: E402
    AttentionParallel, BlockParallel, ColwiseParallel, MLPParallel, NormParallel, RowwiseParallel, SequenceEntry, SequenceExit,
    full_state_dict, llama_plan, load_full_state_dict, param_groups, parallelize,
)

__all__ += ["ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm", "ParallelLayerNorm", "ParallelAttention", "ParallelMLP",
            "parallelize", "llama_plan", "ColwiseParallel", "RowwiseParallel", "NormParallel", "AttentionParallel", "MLPParallel",
            "BlockParallel", "SequenceEntry", "SequenceExit", "full_state_dict", "load_full_state_dict", "param_groups"]

# vocabulary parallelism, activation checkpointing, data parallelism (hal/parallel/vocab.py, checkpoint.py, data.py)
# (the module hal.parallel.checkpoint keeps its name: its function checkpoint() is not re-exported here)
from hal.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead, vocab_parallel_linear_cross_entropy  # noqa: E402
from hal.parallel.checkpoint import checkpoint_blocks, is_recomputing, remove_checkpointing, selective_policy  # noqa: E402
from hal.parallel.data import data_parallel, fully_shard_model  # noqa: E402
from hal.parallel.memory import PeakMemory  # noqa: E402

__all__ += ["VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_linear_cross_entropy", "checkpoint_blocks",
            "remove_checkpointing", "selective_policy", "is_recomputing", "data_parallel", "fully_shard_model", "PeakMemory"]

# expert parallelism and pipeline stages (hal/parallel/expert.py, pipeline.py)
from hal.parallel.expert import ExpertParallelMoE, moe_aux_loss  # noqa: E402
from hal.parallel.pipeline import LlamaStage, PipelineParallel, split_llama, split_model, split_sequential  # noqa: E402

__all__ += ["ExpertParallelMoE", "moe_aux_loss", "PipelineParallel", "LlamaStage", "split_model", "split_sequential", "split_llama"]
