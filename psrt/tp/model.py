"""The tensor-parallel transformer LM, the mirror of psrt.train.models.TransformerLM.

Same layout (`embed` -> `blocks` -> `head`, so a pipeline stage takes a run of blocks the
same way), same computation, weights split over the TP ranks:
  embed: vocabulary-parallel token embedding, position embedding replicated;
  block: LayerNorms replicated, attention with heads split (attention.py), MLP as a
         column-parallel then a row-parallel linear (Shoeybi et al. 2019, fig. 3a);
  head:  LayerNorm replicated, vocabulary-parallel output projection whose logits go
         straight into the vocabulary-parallel cross-entropy (loss.py).
Replicated parameters get identical gradients on every TP rank without communication: their
inputs and output gradients are already whole and equal everywhere (f and g see to it).

With `sequence_parallel` (Korthikanti et al. 2022, sec. 4.2.2) the residual stream between
the blocks' tensor-parallel regions holds 1/t of the sequence on each rank: the embedding's
output is cut along the sequence, each column-parallel layer all-gathers its input (f-bar),
each row-parallel layer reduce-scatters its output (g-bar), and the head's projection gathers
the sequence back.  The LayerNorms and the row-parallel biases then see only this rank's
tokens: their gradients are marked `sequence_parallel` and summed over the TP group after
backward (psrt.tp.comm.reduce_sequence_parallel_grads).

A block whose MLP is not the dense Linear-GELU-Linear (a mixture of experts, --model moe) keeps
that module whole on every TP rank: its input is whole and equal there, so each TP rank
computes the same and the gradients agree without communication, like the LayerNorms'.
(An MoE layer spreads its experts over the expert-parallel group instead, psrt.ep, whose
ranks share the TP rank.)

`shard_dense` loads a dense psrt.train.models.TransformerLM into it; `shard_specs` says which
slice of which dense tensor each parameter is, so tests and psrt.train.hybrid compare parameters
and gradients with a single-process run.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from psrt.collectives.layout import shard_range
from psrt.errors import PsrtError
from psrt.tp.attention import ParallelAttention, head_rows
from psrt.tp.comm import scatter_seq
from psrt.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from psrt.tp.loss import vocab_parallel_cross_entropy


class ParallelMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, group, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(hidden, dim, group, sequence_parallel=sequence_parallel)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int, hidden: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = ParallelAttention(dim, heads, group, sequence_parallel=sequence_parallel)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = ParallelMLP(dim, hidden, group, sequence_parallel)
        _mark(sequence_parallel, self.ln1, self.ln2)
        self.recompute = False

    def forward(self, x):
        if self.recompute and torch.is_grad_enabled():
            # As psrt.train.models.Block: keep the input, run the block again in backward.
            # The recomputation repeats the block's collectives, in the same order on every
            # TP rank, so they still match.
            return checkpoint(self._forward, x, use_reentrant=True)
        return self._forward(x)

    def _forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _mark(sequence_parallel: bool, *modules) -> None:
    """Mark the parameters of modules that see only this rank's slice of the sequence."""
    for m in modules:
        for p in m.parameters():
            p.sequence_parallel = sequence_parallel


class ParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, max_len: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.tok = VocabParallelEmbedding(vocab, dim, group)
        self.pos = nn.Embedding(max_len, dim)

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return scatter_seq(h, self.group) if self.sequence_parallel else h


class ParallelHead(nn.Module):
    """Final LayerNorm and this rank's slice of the vocabulary logits."""

    def __init__(self, vocab: int, dim: int, group, sequence_parallel: bool = False):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = ColumnParallelLinear(dim, vocab, group, sequence_parallel=sequence_parallel)
        _mark(sequence_parallel, self.ln)

    def forward(self, h):
        return self.out(self.ln(h))


class TPTransformerLM(nn.Module):
    """Causal LM over `group` (a psrt Communicator of the TP ranks); forward gives this
    rank's vocabulary slice of the logits, `loss` the mean cross-entropy of all tokens."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_len: int, group,
                 hidden: int | None = None, sequence_parallel: bool = False):
        super().__init__()
        self.vocab, self.dim, self.heads, self.group = vocab, dim, heads, group
        self.hidden = hidden or 4 * dim
        self.max_len = max_len
        self.sequence_parallel = sequence_parallel
        sp = sequence_parallel
        self.embed = ParallelEmbedding(vocab, dim, max_len, group, sp)
        self.blocks = nn.ModuleList(ParallelBlock(dim, heads, self.hidden, group, sp) for _ in range(layers))
        self.head = ParallelHead(vocab, dim, group, sp)

    def forward(self, idx):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def loss(self, local_logits, target):
        return vocab_parallel_cross_entropy(local_logits, target, self.group, self.vocab)


def loss_fn(group, vocab: int):
    """(local logits, target) -> mean loss; the last pipeline stage's loss for a TP LM."""
    return lambda logits, target: vocab_parallel_cross_entropy(logits, target, group, vocab)


def shard_specs(model: TPTransformerLM) -> dict[str, tuple[str, int | None, torch.Tensor | None]]:
    """TP parameter name -> (dense parameter name, dim it is sliced along or None, indices).

    Dense names are those of psrt.train.models.TransformerLM.
    """
    g, d, h, v = model.group, model.dim, model.hidden, model.vocab

    def rng(n):
        return torch.arange(*shard_range(n, g.size, g.rank))
    heads = head_rows(d, model.heads, g.size, g.rank)
    vocab, hid = rng(v), rng(h)
    specs = {"embed.tok.weight": ("embed.tok.weight", 0, vocab),
             "embed.pos.weight": ("embed.pos.weight", None, None),
             "head.ln.weight": ("head.ln.weight", None, None),
             "head.ln.bias": ("head.ln.bias", None, None),
             "head.out.weight": ("head.out.weight", 0, vocab),
             "head.out.bias": ("head.out.bias", 0, vocab)}
    for i in range(len(model.blocks)):
        t, s = f"blocks.{i}.", f"blocks.{i}."
        whole = (None, None)
        specs.update({
            t + "ln1.weight": (s + "ln1.weight", *whole), t + "ln1.bias": (s + "ln1.bias", *whole),
            t + "ln2.weight": (s + "ln2.weight", *whole), t + "ln2.bias": (s + "ln2.bias", *whole),
            t + "attn.qkv.weight": (s + "qkv.weight", 0, heads),
            t + "attn.qkv.bias": (s + "qkv.bias", 0, heads),
            t + "attn.proj.weight": (s + "proj.weight", 1, heads[:d // g.size]),
            t + "attn.proj.bias": (s + "proj.bias", *whole),
        })
        mlp = model.blocks[i].mlp
        if isinstance(mlp, ParallelMLP):
            specs.update({
                t + "mlp.fc1.weight": (s + "mlp.0.weight", 0, hid), t + "mlp.fc1.bias": (s + "mlp.0.bias", 0, hid),
                t + "mlp.fc2.weight": (s + "mlp.2.weight", 1, hid), t + "mlp.fc2.bias": (s + "mlp.2.bias", *whole),
            })
        else:                                       # kept whole: the dense names
            specs.update({t + "mlp." + name: (s + "mlp." + name, *whole) for name, _ in mlp.named_parameters()})
    return specs


def take(spec, tensor: torch.Tensor) -> torch.Tensor:
    """The slice of a dense tensor that a spec from `shard_specs` names."""
    _, dim, index = spec
    t = tensor.detach()
    return t.clone() if dim is None else t.index_select(dim, index.to(t.device))


def _dense_mlp(mlp: nn.Module) -> bool:
    """Whether a dense block's MLP is the Linear-GELU-Linear that TP splits."""
    return isinstance(mlp, nn.Sequential) and len(mlp) == 3 and isinstance(mlp[0], nn.Linear)


def shard_dense(dense: nn.Module, group, sequence_parallel: bool = False) -> TPTransformerLM:
    """A TPTransformerLM holding this rank's slices of a dense psrt.train.models.TransformerLM."""
    try:
        vocab, dim = dense.embed.tok.num_embeddings, dense.embed.tok.embedding_dim
        heads, max_len = dense.blocks[0].heads, dense.embed.pos.num_embeddings
        mlps = [b.mlp for b in dense.blocks if _dense_mlp(b.mlp)]
        hidden = mlps[0][0].out_features if mlps else 4 * dim
    except (AttributeError, IndexError, TypeError) as err:
        raise PsrtError(f"shard_dense needs a psrt.train.models.TransformerLM (embed.tok, embed.pos, "
                        f"blocks[i].qkv/proj/mlp, head.ln/out): {err}") from None
    # Each rank initialises shards of its own sizes: keep that from moving the caller's RNG,
    # so what the caller draws next is the same on every rank and for every TP degree.
    with torch.random.fork_rng(devices=[]):
        model = TPTransformerLM(vocab, dim, len(dense.blocks), heads, max_len, group, hidden, sequence_parallel)
    for block, source in zip(model.blocks, dense.blocks):
        block.recompute = getattr(source, "recompute", False)        # --recompute carries over
        if not _dense_mlp(source.mlp):
            if sequence_parallel:
                raise PsrtError("--sequence-parallel: a block whose MLP is not Linear-GELU-Linear (a mixture "
                                "of experts) takes whole sequences; leave --sequence-parallel out",
                                everywhere=True)
            block.mlp = copy.deepcopy(source.mlp)     # the whole module, on every TP rank
    state = dict(dense.named_parameters())
    specs = shard_specs(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(take(specs[name], state[specs[name][0]]))
    return model
