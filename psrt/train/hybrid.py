"""DP x PP x TP training of the transformer LM on a psrt.grid.Grid, as a library.

Inside a pipeline stage the blocks are tensor-parallel over grid.tp_group (psrt.tp); the
stages form a pipeline over grid.pp_comm running a psrt.pp schedule; every (pp, tp) shard
is replicated over the dp axis, and its gradients are averaged over grid.dp_group with a
selectable algorithm (ring or ps, or any psrt algorithm) before the optimizer steps.  The
layout and the step are psrt.train.layout.OnGrid's, the same as `python -m psrt.train
--pp/--tp` (which attaches any --dp strategy there).

With mixture-of-experts blocks (--model moe) the grid's expert-parallel axis, carved out of
dp, spreads each MoE layer's experts (psrt.ep); the layer is whole on every TP rank.  Expert
gradients are averaged over the ranks holding the same experts (grid.edp_group), the rest
over dp; each layer attaches its balance loss to its output (psrt.ep.layer.AttachAux), so
the stage that holds it backpropagates it.

Exactness: micro-batch i on data-parallel rank d is weighted by dp times its share of the
GLOBAL batch's target tokens, and the gradients are averaged over dp, so a step computes the
gradient of the global batch's mean loss exactly, for any batch size, dp degree or
micro-batch count (tests/mpi/test_hybrid.py checks it against one process).

    grid = Grid.build(world.comm, pp=2, tp=2)                     # dp inferred
    trainer = HybridTrainer(grid, HybridConfig(layers=4, microbatches=4))
    for x, y in batches:                                     # global batches, same on every rank
        stats = trainer.step(x, y)                           # stats.loss: global mean loss
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from psrt.collectives.layout import shard_range
from psrt.dp.base import StepStats as DPStepStats
from psrt.dp.common import optimizer_factory
from psrt.errors import PsrtError, make_options
from psrt.grid import Grid
from psrt.pp import split_batch


@dataclass
class HybridConfig:
    """Model, schedule and optimizer of a hybrid run.

    vocab, dim, layers, heads, seq_len: the psrt.train.models.TransformerLM (MLP width 4*dim).
    schedule: 'gpipe', '1f1b' or 'interleaved'.  microbatches: per data-parallel rank and
    step.  virtual_stages: stages per pipeline rank ('interleaved' only).
    splits: explicit stage split points over [embed, block 0..L-1, head] (default:
    balanced by parameter count).  dp_algorithm: psrt allreduce algorithm for the
    gradients over the dp axis ('ring', 'ps', 'native', 'auto', ...).
    optimizer: 'sgd' (with momentum) or 'adam'.  seed: initialisation of the dense model.
    sequence_parallel: split the activations between the TP regions along the sequence
    (psrt.tp.model; Korthikanti et al. 2022).
    timeout_s: how long a pipeline receive waits before it raises (default PSRT_TIMEOUT).
    """

    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seq_len: int = 64
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int = 1
    splits: tuple | None = None
    dp_algorithm: str = "ring"
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0
    timeout_s: float | None = None
    sequence_parallel: bool = False

    @classmethod
    def for_model(cls, model: nn.Module, **options) -> "HybridConfig":
        """The config of an existing psrt.train.models.TransformerLM (vocab, dim, layers, heads and
        seq_len read from it), with `options` for the rest."""
        try:
            shape = dict(vocab=model.embed.tok.num_embeddings, dim=model.embed.tok.embedding_dim,
                         layers=len(model.blocks), heads=model.blocks[0].heads,
                         seq_len=model.embed.pos.num_embeddings)
        except (AttributeError, IndexError, TypeError):
            raise PsrtError("--pp/--tp need --model transformer (a psrt.train.models.TransformerLM)",
                            everywhere=True) from None
        return cls.make(**shape, **options)

    @classmethod
    def make(cls, **options) -> "HybridConfig":
        """HybridConfig(**options), with an unknown option a one-line PsrtError that lists
        the accepted ones (not a TypeError from deep inside dataclasses)."""
        return make_options(cls, options, "HybridConfig")

    def check(self, grid: Grid) -> None:
        stages = grid.pp * self.virtual_stages
        if stages > self.layers + 2:
            raise PsrtError(f"pp={grid.pp} x virtual_stages={self.virtual_stages} = {stages} stages "
                            f"but the model has only {self.layers + 2} blocks (embedding, "
                            f"{self.layers} layers, head): add layers or lower --pp", everywhere=True)
        if self.heads % grid.tp or self.dim % self.heads:
            raise PsrtError(f"tp={grid.tp} needs heads ({self.heads}) divisible by tp and dim "
                            f"({self.dim}) divisible by heads", everywhere=True)
        if self.optimizer not in ("sgd", "adam"):
            raise PsrtError(f"optimizer {self.optimizer!r}: choose sgd or adam", everywhere=True)


def dense_model(cfg: HybridConfig) -> nn.Module:
    """The single-process reference: psrt.train.models.TransformerLM initialised from cfg.seed."""
    from psrt.train.models import TransformerLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return TransformerLM(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads,
                             max_len=cfg.seq_len)


class HybridTrainer:
    """This rank's part of the model (its stages, TP-sharded), its pipeline and optimizer: the
    library face of psrt.train.layout.OnGrid with a ring all-reduce (cfg.dp_algorithm) over
    the dp axis, stepped with whole global batches.

    Args:
        grid: the process grid.
        cfg: model, schedule and optimizer settings.
        dense: a dense psrt.train.models.TransformerLM to start from (default: `dense_model(cfg)`);
            identical on every rank.  Only this rank's slice is kept.
        device: where the stages and activations live.
        make_optimizer: params -> optimizer (default: cfg.optimizer from torch.optim), as
            in the DataParallel contract (psrt/dp/base.py).
        tracer: a psrt.trace.Tracer for the pipeline's spans, its sends and receives and the
            optimizer (default: the grid's, whose Communicators record the DP, TP and expert
            collectives).
        compute_dtype: run the stages' forward under autocast in this dtype (bf16, fp16), the
            parameters staying fp32 (psrt.dp.precision).
        scaler: a psrt.dp.precision.LossScaler for fp16: the loss is scaled before backward;
            make_optimizer should then build ScaledOptimizers on the same scaler.
    """

    def __init__(self, grid: Grid, cfg: HybridConfig, dense: nn.Module | None = None, device="cpu",
                 make_optimizer=None, tracer=None, compute_dtype=None, scaler=None):
        from psrt.train.layout import OnGrid
        cfg.check(grid)
        self.grid, self.cfg = grid, cfg
        make_optimizer = make_optimizer or optimizer_factory(cfg.optimizer, cfg.lr, cfg.momentum)
        self.layout = OnGrid(grid, dense if dense is not None else dense_model(cfg), "ring",
                             {"algorithm": cfg.dp_algorithm}, make_optimizer, cfg.microbatches, compute_dtype,
                             scaler, cfg.sequence_parallel, tracer, schedule=cfg.schedule,
                             virtual_stages=cfg.virtual_stages, splits=cfg.splits, timeout_s=cfg.timeout_s,
                             device=device, pipeline=True)
        self.schedule, self.runtime, self.params = self.layout.schedule, self.layout.runtime, self.layout.params
        self.specs = self.layout.specs
        self.optimizer = self.layout.components[0].optimizer
        self.num_experts = self.layout.num_experts

    def named_parameters(self):
        """(name in TPTransformerLM, parameter) for the parameters this rank holds."""
        return [(self.layout.names[id(p)], p) for p in self.params]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> DPStepStats:
        """One optimizer step on the global batch (x, y), identical on every rank: this dp
        rank's equal share, cut into cfg.microbatches.

        Returns the training loop's StepStats (psrt.dp.base): loss is the global batch's
        mean loss (the same on every rank); bytes_sent what this rank put on the wire, with
        extra dp_, pp_, tp_ and ep_bytes_sent apart; extra also holds the pipeline figures
        (step_s, bubble, peak_activation_bytes, peak_live_microbatches) and, with MoE
        layers, moe: the step's routing over every layer of the model.
        """
        g, cfg = self.grid, self.cfg
        if x.shape[0] < g.dp * cfg.microbatches:
            raise PsrtError(f"global batch of {x.shape[0]} sequences is too small for dp={g.dp} x "
                            f"{cfg.microbatches} micro-batches", everywhere=True)
        mine = slice(*shard_range(x.shape[0], g.dp, g.dp_rank))
        xs, ys, _ = split_batch(x[mine], y[mine], cfg.microbatches)
        stats = self.layout.step(list(zip(xs, ys)), global_tokens=y.numel())
        # comm_s is the data-parallel components' own blocked time: the pipeline's receive
        # waits are not in it (taking them out again made the dp figure negative)
        pp = self.layout.pp_stats
        stats.extra.update(step_s=pp.total_s, bubble=pp.bubble, peak_activation_bytes=pp.peak_activation_bytes,
                           peak_live_microbatches=pp.peak_live_microbatches, dp_comm_s=stats.comm_s)
        stats.extra.setdefault("moe", None)
        return stats

    def dense_state_dict(self, root: int = 0) -> dict | None:
        """The whole model as a psrt.train.models.TransformerLM state dict, assembled on grid
        rank `root` (None on the other ranks)."""
        model = self.layout.whole(root)
        return None if model is None else {k: v.clone() for k, v in model.state_dict().items()}


def run(grid: Grid, cfg: HybridConfig, batches, dense: nn.Module | None = None, device="cpu",
        on_step=None, make_optimizer=None) -> tuple[HybridTrainer, list[DPStepStats]]:
    """Train on `batches` (an iterable of global (x, y) batches, the same on every rank).

    `on_step(step, stats)` is called after each step (e.g. to print on grid rank 0).
    Returns the trainer (for dense_state_dict, named_parameters) and each step's stats.
    """
    trainer = HybridTrainer(grid, cfg, dense, device, make_optimizer)
    history = []
    for step, (x, y) in enumerate(batches):
        stats = trainer.step(x, y)
        history.append(stats)
        if on_step is not None:
            on_step(step, stats)
    return trainer, history
