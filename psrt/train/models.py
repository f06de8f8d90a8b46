"""The models `python -m psrt.train --model NAME` trains: small enough for a laptop CPU.

None of them uses dropout or batch normalisation, so a step is a pure function of the
parameters and the batch: N ranks and one process must agree (the equivalence tests rely
on it).

The transformer is laid out for pipeline parallelism: `embed` -> `blocks` (a ModuleList of
identical pre-norm blocks, the unit a pipeline stage takes a contiguous run of) -> `head`,
and its `forward` is nothing but those three, so a stage runs `embed` (first stage only),
its slice of `blocks`, and `head` (last stage only).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch import nn

from psrt.errors import PsrtError
from psrt.ep.layer import MoELayer
from psrt.train.config import MODELS



class MLP(nn.Module):
    """Fully connected classifier: in -> hidden (ReLU) x depth -> classes."""

    def __init__(self, in_features: int, classes: int, hidden: int = 128, depth: int = 1):
        super().__init__()
        layers, width = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))


class CNN(nn.Module):
    """Two 3x3 convolutions and a max-pool for 1x8x8 images (the digits), then a classifier."""

    def __init__(self, classes: int = 10, channels: int = 16, side: int = 8):
        super().__init__()
        if side % 2:
            raise PsrtError(f"--model cnn needs an even image side, got {side}", everywhere=True)
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Linear(2 * channels * (side // 2) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2 shape): x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        if dim % heads:
            raise PsrtError(f"--width {dim} must divide by the {heads} attention heads", everywhere=True)
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            # Activation recomputation (Chen et al., "Training Deep Nets with Sublinear Memory
            # Cost", 2016): keep only the block's input and run the block again in backward.
            # The reentrant form saves that input through autograd, where the memory ledger's
            # saved-tensor hooks count it; the block has no randomness, so the recomputed
            # values are bit for bit the first ones.
            return checkpoint(self._forward, x, use_reentrant=True)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, vocab: int, dim: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits (no weight tying, so a
    pipeline's last stage owns it without sharing a tensor with the first)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(h))


class TransformerLM(nn.Module):
    """Causal character-level language model: `embed` -> `blocks` -> `head`."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = 64, recompute: bool = False):
        super().__init__()
        self.max_len = max_len
        self.embed = Embedding(vocab, dim, max_len)
        self.blocks = nn.ModuleList(Block(dim, heads, recompute) for _ in range(layers))
        self.head = Head(vocab, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(name: str, dataset, width: int = 0, layers: int = 0, recompute: bool = False,
                **moe) -> nn.Module:
    """The model `name` shaped for `dataset` (a psrt.train.data.Dataset).

    width: hidden units (mlp), channels x 8 (cnn) or model dimension (transformer, moe);
    layers: hidden layers (mlp) or blocks (transformer, moe).  0 picks the model's default.
    recompute: recompute each transformer block in backward instead of keeping its activations.
    moe: for "moe", the MoELayer's keywords (experts, top_k, capacity_factor, aux_alpha,
    dispatch): the transformer with every block's MLP a mixture of experts of the same shape.
    """
    if name == "moe":
        model = build_model("transformer", dataset, width, layers, recompute)
        for block in model.blocks:
            dim = block.ln2.normalized_shape[0]
            block.mlp = MoELayer(dim, 4 * dim, **moe)
        return model
    if name == "mlp":
        if dataset.task != "classify":
            raise PsrtError(f"--model mlp classifies; --data {dataset.name} is a language-model "
                            "corpus (use --model transformer)", everywhere=True)
        return MLP(dataset.input_shape.numel(), dataset.classes, hidden=width or 128, depth=layers or 1)
    if name == "cnn":
        shape = tuple(dataset.input_shape)
        if dataset.task != "classify" or len(shape) != 3 or shape[0] != 1 or shape[1] != shape[2]:
            raise PsrtError(f"--model cnn needs square one-channel images; --data {dataset.name} "
                            f"gives inputs of shape {shape}", everywhere=True)
        return CNN(dataset.classes, channels=max(4, (width or 128) // 8), side=shape[1])
    if name == "transformer":
        if dataset.task != "lm":
            raise PsrtError(f"--model transformer is a language model; use --data text "
                            f"(got --data {dataset.name})", everywhere=True)
        return TransformerLM(vocab=dataset.classes, dim=width or 64, layers=layers or 2,
                             max_len=dataset.input_shape[0], recompute=recompute)
    raise PsrtError(f"--model {name!r}: choose one of {', '.join(MODELS)}", everywhere=True)


def loss_and_correct(model: nn.Module, batch, task: str, loss=None) -> tuple[torch.Tensor, int | None, int]:
    """(mean loss, correct predictions, predictions) of `model` on `batch`: cross-entropy, or
    `loss(output, target)` when given.  Correct is None where targets are not class indices
    shaped like the output without its last dimension (nothing to count)."""
    x, y = batch
    logits = model(x)
    if loss is not None:
        value = loss(logits, y)
    elif task == "lm":
        value = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    else:
        value = F.cross_entropy(logits, y)
    countable = torch.is_tensor(logits) and not y.is_floating_point() and logits.shape[:-1] == y.shape
    return value, int((logits.argmax(-1) == y).sum()) if countable else None, y.numel()
