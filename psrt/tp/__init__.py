"""Tensor parallelism (Shoeybi et al., "Megatron-LM", 2019): the f/g operators (comm.py),
column/row-parallel linear and vocabulary-parallel embedding (layers.py), attention with
heads split (attention.py), vocabulary-parallel cross-entropy (loss.py) and the TP
transformer LM with its loader from the dense psrt.train.models.TransformerLM (model.py).
Every layer takes `group`, a psrt Communicator over the TP ranks (Grid.tp_group).
"""
from psrt.tp.attention import ParallelAttention
from psrt.tp.comm import (
           CountingGroup,
           copy_to_tp,
           gather_from_tp,
           reduce_from_tp,
           scatter_to_tp,
)
from psrt.tp.layers import (
           ColumnParallelLinear,
           RowParallelLinear,
           VocabParallelEmbedding,
)
from psrt.tp.loss import vocab_parallel_cross_entropy
from psrt.tp.model import (
           ParallelBlock,
           ParallelMLP,
           TPTransformerLM,
           shard_dense,
           shard_specs,
           take,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelAttention",
           "ParallelMLP", "ParallelBlock", "TPTransformerLM", "shard_dense", "shard_specs", "take",
           "vocab_parallel_cross_entropy", "CountingGroup", "copy_to_tp", "reduce_from_tp",
           "scatter_to_tp", "gather_from_tp"]
