"""hal.parallel: distributed operators on torch.distributed device meshes, proven against one device.

Tensor and sequence parallelism, vocabulary parallelism, expert parallelism and pipeline stages,
built on ``DeviceMesh`` / ``DTensor`` and ``torch.distributed.pipelining``. hal adds its fused
kernels inside each rank's share of the work, and every collective these layers issue goes through
:mod:`hal.dist` (algorithm choice, ``hal.explain``, :class:`hal.dist.CommError` on a dead or
stalled peer). Before its collectives each layer checks, with one small collective, that the
ranks agree on shapes, dtypes, settings and valid ids (:mod:`hal.parallel.checks`,
:func:`set_checks`), so a mismatch is the same error on every rank, never a crashed collective.
"""

from __future__ import annotations

# the layers in the order a model uses them: linear and norms, attention and MLP, the plan that
# applies them and its state dicts; vocabulary, expert and pipeline parallelism; checkpointing and
# data parallelism around them; memory accounting. (hal.parallel.checkpoint keeps its module name:
# its function checkpoint() is not re-exported here.)
from hal.parallel.blocks import ParallelAttention, ParallelMLP
from hal.parallel.checks import IndexOutOfRangeError, set_checks
from hal.parallel.checkpoint import checkpoint_blocks, is_recomputing, remove_checkpointing, selective_policy
from hal.parallel.data import data_parallel, fully_shard_model
from hal.parallel.expert import ExpertParallelMoE, moe_aux_loss
from hal.parallel.memory import PeakMemory
from hal.parallel.pipeline import LlamaStage, PipelineParallel, split_llama, split_model, split_sequential
from hal.parallel.plan import (
    AttentionParallel,
    BlockParallel,
    ColwiseParallel,
    MLPParallel,
    NormParallel,
    RowwiseParallel,
    SequenceEntry,
    SequenceExit,
    llama_plan,
    parallelize,
)
from hal.parallel.state import full_state_dict, load_full_state_dict, param_groups
from hal.parallel.tensor import ColumnParallelLinear, ParallelLayerNorm, ParallelRMSNorm, RowParallelLinear
from hal.parallel.vocab import VocabParallelEmbedding, VocabParallelLMHead, vocab_parallel_linear_cross_entropy

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm", "ParallelLayerNorm", "ParallelAttention", "ParallelMLP",
    "parallelize", "llama_plan", "ColwiseParallel", "RowwiseParallel", "NormParallel", "AttentionParallel", "MLPParallel",
    "BlockParallel", "SequenceEntry", "SequenceExit", "full_state_dict", "load_full_state_dict", "param_groups",
    "VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_linear_cross_entropy",
    "ExpertParallelMoE", "moe_aux_loss", "PipelineParallel", "LlamaStage", "split_model", "split_sequential", "split_llama",
    "checkpoint_blocks", "remove_checkpointing", "selective_policy", "is_recomputing", "data_parallel", "fully_shard_model",
    "PeakMemory", "set_checks", "IndexOutOfRangeError",
]
