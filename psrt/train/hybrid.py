"""DP x PP x TP training of the transformer LM on a psrt.grid.Grid.

Inside a pipeline stage the blocks are tensor-parallel over grid.tp_group (psrt.tp); the
stages form a pipeline over grid.pp_comm running a psrt.pp schedule; every (pp, tp) shard
is replicated over the dp axis, and its gradients are summed over grid.dp_group with a
selectable algorithm (ring or ps, or any psrt algorithm) before the optimizer steps.

With mixture-of-experts blocks (--model moe) the grid's expert-parallel axis, carved out of
dp, spreads each MoE layer's experts (psrt.ep); the layer is whole on every TP rank.  Expert
gradients are summed over the ranks holding the same experts (grid.edp_group), the rest over
dp; each layer attaches its balance loss to its output with weight 1/micro-batches, so the
stage that holds it backpropagates it (psrt.ep.layer.AttachAux).

Exactness: micro-batch i on data-parallel rank d is weighted by its share of the GLOBAL
batch's target tokens, and the gradients are summed (not averaged) over dp, so a step
computes the gradient of the global batch's mean loss exactly, for any batch size, dp
degree or micro-batch count (tests/mpi/test_hybrid.py checks it against one process).

    grid = Grid.build(world.comm, pp=2, tp=2)                     # dp inferred
    trainer = HybridTrainer(grid, HybridConfig(layers=4, microbatches=4))
    for x, y in batches:                                     # global batches, same on every rank
        stats = trainer.step(x, y)                           # stats.loss: global mean loss
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from psrt.collectives.cost import wire_bytes
from psrt.collectives.layout import shard_range
from psrt.dp.base import StepStats as DPStepStats
from psrt.dp.common import copy_back, flatten, optimizer_factory
from psrt.ep.layer import begin_step, moe_layers, tally
from psrt.errors import PsrtError, make_options
from psrt.grid import Grid
from psrt.pp import PipelineRuntime, build_stages, make_schedule, split_batch
from psrt.tp.comm import CountingGroup, reduce_sequence_parallel_grads
from psrt.tp.model import loss_fn, shard_dense, shard_specs
from psrt.trace import OFF


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
    """This rank's part of the model (its stages, TP-sharded), its pipeline and optimizer.

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
        cfg.check(grid)
        self.grid, self.cfg = grid, cfg
        self.tracer = tracer = tracer or grid.tracer or OFF
        # The TP group counts its traffic for the step's bytes_sent.
        self.tp = CountingGroup(grid.tp_group)
        model = shard_dense(dense if dense is not None else dense_model(cfg), self.tp, cfg.sequence_parallel)
        self.num_experts = 0                  # 0: no MoE layers in the model
        for layer in moe_layers(model):
            layer.shard(grid.ep_group, grid.dp_group, algorithm="pairwise")
            self.num_experts = layer.num_experts
        blocks = [model.embed, *model.blocks, model.head]
        self.schedule = make_schedule(cfg.schedule, grid.pp, cfg.microbatches, cfg.virtual_stages)
        stage_ids = self.schedule.stages_of(grid.pp_rank)
        stages = build_stages(blocks, self.schedule.num_stages, stage_ids, cfg.splits)
        self.moe = [m for st in stages.values() for m in moe_layers(st)]      # this rank's MoE layers
        self.expert_ids = {id(p) for m in self.moe for p in m.experts.parameters()}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.specs = expert_specs(model, shard_specs(model))
        for st in stages.values():
            st.to(device)
        loss = loss_fn(self.tp, cfg.vocab)
        if scaler is not None:
            unscaled = loss
            loss = lambda logits, target: scaler(unscaled(logits, target))  # noqa: E731
        self.compute_dtype, self.scaler = compute_dtype, scaler
        self.runtime = PipelineRuntime(stages, self.schedule, grid.pp_comm, loss, device, cfg.timeout_s, tracer)
        self.params = list(self.runtime.parameters())
        make_optimizer = make_optimizer or optimizer_factory(cfg.optimizer, cfg.lr, cfg.momentum)
        self.optimizer = make_optimizer(self.params)
        self.device = torch.device(device)

    def named_parameters(self):
        """(name in TPTransformerLM, parameter) for the parameters this rank holds."""
        return [(self.names[id(p)], p) for p in self.params]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> DPStepStats:
        """One optimizer step on the global batch (x, y), identical on every rank.

        Returns the training loop's StepStats (psrt.dp.base): loss is the global batch's
        mean loss (the same on every rank); compute_s the forward/backward time, comm_s the
        time blocked on pipeline receives plus the dp all-reduce; bytes_sent the bytes this
        rank put on the wire: pipeline sends, tensor-parallel collectives and the dp
        all-reduce (extra: pp_, tp_ and dp_bytes_sent); extra also holds the pipeline figures
        (step_s, bubble, peak_activation_bytes, peak_live_microbatches) and dp_comm_s,
        dp_payload_bytes; with MoE layers, moe: the step's routing over every layer of the
        model (see `_routing`).
        """
        g, cfg = self.grid, self.cfg
        if x.shape[0] < g.dp * cfg.microbatches:
            raise PsrtError(f"global batch of {x.shape[0]} sequences is too small for dp={g.dp} x "
                            f"{cfg.microbatches} micro-batches", everywhere=True)
        mine = slice(*shard_range(x.shape[0], g.dp, g.dp_rank))
        xs, ys, _ = split_batch(x[mine], y[mine], cfg.microbatches)
        weights = [t.numel() / y.numel() for t in ys]       # share of the GLOBAL batch
        for p in self.params:
            p.grad = None
        self.tp.reset()
        # each micro-batch's balance loss weighs 1/micro-batches (fp16: scaled as the loss is)
        begin_step(self.moe, (self.scaler.scale if self.scaler else 1.0) / cfg.microbatches)
        with torch.autocast(self.device.type, dtype=self.compute_dtype or torch.float32,
                            enabled=self.compute_dtype is not None):
            pp = self.runtime.step(xs, ys, weights)
        reduce_sequence_parallel_grads(self.params, self.tp)      # nothing without --sequence-parallel
        t0 = time.perf_counter()
        payload, expert_payload = self._allreduce_grads()
        dp_s = time.perf_counter() - t0
        with self.tracer.span("optimizer", "compute"):
            self.optimizer.step()
        loss = g.dp_comm.allreduce(pp.loss)                 # sum of the dp ranks' shares
        # Wire bytes as a bandwidth-optimal (ring) collective moves them; the TP groups count
        # each all-reduce's payload and each all-gather's local piece.
        tp_sent = (wire_bytes("allreduce", "native", self.tp.bytes.get("allreduce", 0), g.tp, g.tp_rank)
                   + wire_bytes("allgather", "native", g.tp * self.tp.bytes.get("allgather", 0), g.tp, g.tp_rank)
                   + wire_bytes("reduce_scatter", "native", self.tp.bytes.get("reduce_scatter", 0), g.tp, g.tp_rank))
        dp_sent = (wire_bytes("allreduce", cfg.dp_algorithm, payload, g.dp, g.dp_rank)
                   + wire_bytes("allreduce", cfg.dp_algorithm, expert_payload, g.edp_group.size, g.edp_group.rank))
        moe = self._routing() if self.num_experts else None
        return DPStepStats(loss=loss, compute_s=pp.busy_s, comm_s=pp.wait_s + dp_s,
                           bytes_sent=pp.bytes_sent + tp_sent + dp_sent + (moe["a2a_bytes"] if moe else 0),
                           extra={"moe": moe,
                                  "step_s": pp.total_s, "bubble": pp.bubble, "dp_comm_s": dp_s,
                                  "pp_bytes_sent": pp.bytes_sent, "tp_bytes_sent": tp_sent,
                                  "dp_bytes_sent": dp_sent,
                                  "dp_payload_bytes": payload,
                                  "peak_activation_bytes": pp.peak_activation_bytes,
                                  "peak_live_microbatches": pp.peak_live_microbatches})

    def _routing(self) -> dict:
        """The MoE figures of this step as psrt.train.moe's step gives them, the same on every
        rank: routed and dropped per expert summed over every layer of the model, the global
        balance loss (its mean over the micro-batches, as the loss), the number of MoE layers,
        and a2a_bytes, what this rank sent in its layers' all-to-alls.  One all-reduce over
        the grid: each layer's figures are already summed over dp and stand on each of the
        stage's dp x tp ranks, its balance-loss shares on each of its tp ranks."""
        g, E = self.grid, self.num_experts
        mine = tally(self.moe)
        local = torch.zeros(2 * E + 2, dtype=torch.float64)
        if mine["layers"]:
            local[:E], local[E:2 * E] = mine["routed"], mine["dropped"]
        local[2 * E:] = torch.tensor([mine["aux"] / self.cfg.microbatches * g.dp, mine["layers"]])
        total = g.cart_comm.allreduce(local) / (g.dp * g.tp)
        return {"routed": total[:E], "dropped": total[E:2 * E], "aux_loss": float(total[2 * E]),
                "layers": round(float(total[2 * E + 1])), "a2a_bytes": mine["a2a_bytes"]}

    def _allreduce_grads(self) -> tuple[int, int]:
        """Sum the gradients over the dp axis, each group in one flat buffer: experts over
        the ranks holding the same experts (edp), the rest over dp; returns both buffers' bytes."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        payload = []
        for group, params in ((self.grid.dp_group, [p for p in self.params if id(p) not in self.expert_ids]),
                              (self.grid.edp_group, [p for p in self.params if id(p) in self.expert_ids])):
            if group.size == 1 or not params:
                payload.append(0)
                continue
            grads = [p.grad for p in params]
            flat = flatten(grads)
            group.allreduce(flat, op="sum", out=flat, algorithm=self.cfg.dp_algorithm)
            copy_back(flat, grads)
            payload.append(flat.numel() * flat.element_size())
        return payload[0], payload[1]

    def dense_state_dict(self, root: int = 0) -> dict | None:
        """The whole model as a psrt.train.models.TransformerLM state dict, assembled on grid rank
        `root` from every (pp, tp) shard of dp replica 0 (and the experts of its expert-parallel
        group); None on the other ranks."""
        pieces = []
        if self.grid.dp_rank < self.grid.ep:
            for name, p in self.named_parameters():
                if self.grid.dp_rank > 0 and id(p) not in self.expert_ids:
                    continue
                dense_name, dim, index = self.specs[name]
                pieces.append((dense_name, dim, None if index is None else index.tolist(),
                               p.detach().cpu()))
        gathered = self.grid.cart_comm.gather(pieces, root=root)
        if gathered is None:
            return None
        state: dict[str, torch.Tensor] = {}
        for dense_name, dim, index, t in (x for part in gathered for x in part):
            if dim is None:
                state[dense_name] = t
                continue
            shape = list(t.shape)
            shape[dim] = max(max(index) + 1, state[dense_name].shape[dim] if dense_name in state else 0)
            full = torch.zeros(shape, dtype=t.dtype)
            if dense_name in state:
                old = state[dense_name]
                full.narrow(dim, 0, old.shape[dim]).copy_(old)
            state[dense_name] = full.index_copy_(dim, torch.tensor(index), t)
        return state


def expert_specs(model: nn.Module, specs: dict) -> dict:
    """`specs` with each MoE layer's local experts named by their global index (local expert
    i of a layer whose first expert is f is the dense model's expert f + i)."""
    out = dict(specs)
    for b, block in enumerate(model.blocks):
        first = getattr(block.mlp, "first_expert", 0)
        prefix = f"blocks.{b}.mlp.experts."
        for name, (dense_name, dim, index) in specs.items():
            if name.startswith(prefix):
                i, rest = name[len(prefix):].split(".", 1)
                out[name] = (f"{prefix}{first + int(i)}.{rest}", dim, index)
    return out


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
