"""A run's layout: this rank's part of the model, its forward and backward passes, and the
data-parallel components attached to its parameters.  The training loop (loop.py) is the
same for every layout; only what is built here differs.

- `Plain`: the whole model on every rank, the world is the data-parallel group; every
  strategy of psrt.dp, the parameter servers' dedicated server ranks included.
- `OnGrid`: the transformer on a DP x PP x TP grid (psrt.grid), with mixture-of-experts
  blocks spread over the expert-parallel ranks carved out of dp (--model moe, --ep).  The
  layout runs the passes (a pipeline schedule for --pp > 1, else the micro-batches one after
  another through the tensor-parallel model) and the strategy of --dp is attached as a
  component (psrt.dp.base) to this rank's parameters over the grid's dp group, and to its
  experts' parameters over the expert-data-parallel group: the Megatron-LM shape (its
  DistributedDataParallel and DistributedOptimizer on the data-parallel group after the
  pipeline schedule; expert buffers on the expert-data-parallel group).

Which strategy runs in which layout, and why not where it does not: `refusal` (the table
docs/how-to/training.md shows, tested against it).
"""
from __future__ import annotations

import torch
from torch import nn

from psrt.collectives.cost import wire_bytes
from psrt.dp import strategy_class
from psrt.dp.driver import Driver
from psrt.dp.passes import local, run_step
from psrt.errors import PsrtError
from psrt.trace import OFF

# Why a strategy cannot run on a grid at all (--pp/--tp/--model moe), by name.
NOT_ON_A_GRID = {
    "ps-async": "its dedicated server runs an asynchronous protocol of its own, and every rank of "
                "a grid holds a part of the model, so no rank is left to serve",
    "horovod": "Horovod reduces over its own world communicator (hvd.init), not over a group of a grid",
    "torch": "it reduces over torch.distributed's default group, the whole world, and a grid's "
             "data-parallel groups are parts of it: use ring or native",
}


def axes(pp: int, tp: int, moe: bool) -> list[str]:
    """The model-parallel axes of a layout, as the flags name them."""
    return [a for a, on in (("--pp", pp > 1), ("--tp", tp > 1), ("--model moe", moe)) if on]


def refusal(dp: str, pp: int = 1, tp: int = 1, moe: bool = False, *, ep: int = 1, sequence_parallel: bool = False,
            precision: str = "fp32", servers: int | None = None) -> str | None:
    """Why --dp `dp` cannot train in this layout (one line), or None where it can."""
    on = axes(pp, tp, moe)
    if not on:
        return None
    where = " with " + " ".join(on)
    if dp in NOT_ON_A_GRID:
        return f"--dp {dp}{where}: " + NOT_ON_A_GRID[dp]
    cls = strategy_class(dp)
    if pp > 1 and not cls.interleaved_ok:
        return (f"--dp {dp} with --pp: a pipeline stage keeps several micro-batches in flight, so "
                "zero3 would gather every unit again for each forward and backward action; use zero1 "
                "or zero2 (Megatron-LM's distributed optimizer)")
    if sequence_parallel and not cls.interleaved_ok:
        return (f"--dp {dp} with --sequence-parallel: the LayerNorm gradients are summed over the TP "
                "group after backward, so zero3 cannot reduce its units during backward; use zero1 or zero2")
    if moe and ep > 1 and not cls.interleaved_ok:
        return (f"--dp {dp} with --model moe --ep {ep}: the experts' parameters reduce over the expert-data-parallel "
                "group and the rest over dp, and zero3 shards whole modules over one group; use zero1 or zero2")
    if servers and dp.startswith("ps"):
        return (f"--servers {servers} with {' '.join(on)}: every rank of a grid holds a stage or shard of "
                "the model; --dp ps serves from dp rank 0 of each group, ps-sharded from every dp rank "
                "(--servers 0)")
    if moe and ep > 1 and precision == "fp16" and (cls.frees_grads or dp.startswith("ps")):
        return (f"--precision fp16 --dp {dp} with --model moe --ep {ep}: the dense and expert gradients need one "
                f"overflow decision, which {dp} takes inside its reduction, group by group; use bf16, "
                "or --dp ring, native or zero1")
    return None


class Plain:
    """The whole model on every rank: the strategy of --dp over the world (psrt.dp.driver),
    its dedicated server ranks serving."""

    def __init__(self, model, make_optimizer, dp: str, group, loss_fn, options: dict):
        self.model, self.loss_fn = model, loss_fn
        self.driver = Driver(model, make_optimizer, dp, group, **options)
        self.num_workers, self.worker_rank = self.driver.num_workers, max(self.driver.worker_rank, 0)
        self.is_worker = self.driver.is_worker
        self.state = self.driver                  # what a checkpoint saves and loads
        self.components = [self.driver.strategy]

    def step(self, microbatches: list):
        return self.driver.step(self.loss_fn, microbatches=microbatches)

    def serve(self, rounds: int | None = None) -> None:
        self.driver.serve(rounds)

    def finish(self) -> None:
        self.driver.finish()

    def whole(self) -> nn.Module | None:
        """The one-process model with the trained parameters (on the lead worker: its own)."""
        return self.model

    def label(self, dp: str) -> str:
        return f"{dp} x{self.num_workers}"

    def params_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def bytes_sent(self) -> int:
        return self.driver.bytes_sent

    def free(self) -> None:
        pass


class OnGrid:
    """The transformer (or its mixture-of-experts form) on a DP x PP x TP grid, with the
    strategy of --dp attached over the grid's data-parallel groups (see the module).

    Args:
        grid: the psrt.grid.Grid (ep included).
        dense: the one-process model, identical on every rank; this rank keeps its slice.
        dp, options: the strategy and its options.
        make_optimizer: params -> optimizer (a ScaledFactory for fp16).
        microbatches: per data-parallel rank and step (the pipeline schedule's m).
        compute_dtype, scaler: --precision's autocast dtype and fp16 LossScaler.
        sequence_parallel: Korthikanti et al.'s split of the TP regions (psrt.tp.model).
    """

    def __init__(self, grid, dense: nn.Module, dp: str, options: dict, make_optimizer, microbatches: int,
                 compute_dtype=None, scaler=None, sequence_parallel: bool = False, tracer=None, *,
                 schedule: str = "1f1b", virtual_stages: int = 1, splits=None, timeout_s: float | None = None,
                 device="cpu", pipeline: bool | None = None):
        from psrt.ep.layer import moe_layers
        from psrt.pp import PipelineRuntime, build_stages, make_schedule
        from psrt.tp.comm import CountingGroup
        from psrt.tp.model import loss_fn, shard_dense, shard_specs
        self.grid, self.dense, self.tracer = grid, dense, tracer or grid.tracer or OFF
        self.compute_dtype, self.scaler, self.sequence_parallel = compute_dtype, scaler, sequence_parallel
        self.device = torch.device(device)
        g = grid
        self.tp = CountingGroup(g.tp_group)           # counts the TP traffic of a step
        model = shard_dense(dense, self.tp, sequence_parallel)
        for layer in moe_layers(model):
            layer.shard(g.ep_group, g.dp_group, algorithm="pairwise")
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.specs = expert_specs(model, shard_specs(model))
        loss = loss_fn(self.tp, dense.head.out.out_features)
        if scaler is not None:           # the value unchanged, its gradient scaled (precision.py)
            unscaled = loss
            loss = lambda logits, target: scaler(unscaled(logits, target))  # noqa: E731
        self.loss = loss
        self.runtime = None
        if g.pp > 1 if pipeline is None else pipeline:
            self.schedule = make_schedule(schedule, g.pp, microbatches, virtual_stages)
            stages = build_stages([model.embed, *model.blocks, model.head], self.schedule.num_stages,
                                  self.schedule.stages_of(g.pp_rank), splits)
            for st in stages.values():
                st.to(self.device)
            self.runtime = PipelineRuntime(stages, self.schedule, g.pp_comm, loss, self.device, timeout_s,
                                           tracer=self.tracer)
            self.model = nn.ModuleList(stages[s] for s in sorted(stages))
        else:
            self.model = model.to(self.device)
        self.moe = moe_layers(self.model)                 # this rank's MoE layers
        every = moe_layers(model)                         # the model's, on every stage
        self.num_experts = every[0].num_experts if every else 0
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.expert_ids = {id(p) for m in self.moe for p in m.experts.parameters()}
        self.components = attach(g, self.model, self.params, self.expert_ids, dp, options, make_optimizer)
        self.num_workers, self.worker_rank, self.is_worker = g.dp, g.dp_rank, True
        self.state = GridState(self)
        self.pp_stats = None

    # ------------------------------------------------------------------ a step
    def _passes(self, microbatches: list, components: list) -> float:
        from psrt.tp.comm import reduce_sequence_parallel_grads
        self.tp.reset()
        begin_moe_step(self.grid, self.moe, len(microbatches), self.scaler)
        with torch.autocast(self.device.type, dtype=self.compute_dtype or torch.float32,
                            enabled=self.compute_dtype is not None):
            if self.runtime is not None:
                xs, ys = [mb[0] for mb in microbatches], [mb[1] for mb in microbatches]
                # Each micro-batch weighs its share of this rank's targets, or, given the
                # global batch's (a library caller's uneven split), dp times its share of
                # those: either way the dp average is the global batch's mean loss.
                share = self.global_tokens / self.grid.dp if self.global_tokens else sum(y.numel() for y in ys)
                self.pp_stats = self.runtime.step(xs, ys, [y.numel() / share for y in ys])
                loss = self.pp_stats.loss
            else:
                # The LayerNorm gradients of --sequence-parallel are summed over the TP group
                # after backward: the components reduce after it too, not during backward.
                passes = local(lambda mb: self.loss(self.model(mb[0].to(self.device)), mb[1].to(self.device)),
                               self.tracer)
                loss = passes(microbatches, [] if self.sequence_parallel else components)
        reduce_sequence_parallel_grads(self.params, self.tp)
        return loss

    def step(self, microbatches: list, global_tokens: int | None = None):
        """One step of this rank's micro-batches [(x, y), ...]; `global_tokens`: the targets of
        the whole global batch where the dp ranks' shares may differ (pipeline only)."""
        self.global_tokens = global_tokens
        stats = run_step(self.components, self._passes, microbatches, self.scaler)
        g = self.grid
        # Wire bytes as a bandwidth-optimal (ring) collective moves them; the TP group counts
        # each all-reduce's payload and each all-gather's local piece.
        tp = self.tp.bytes
        tp_sent = (wire_bytes("allreduce", "native", tp.get("allreduce", 0), g.tp, g.tp_rank)
                   + wire_bytes("allgather", "native", g.tp * tp.get("allgather", 0), g.tp, g.tp_rank)
                   + wire_bytes("reduce_scatter", "native", tp.get("reduce_scatter", 0), g.tp, g.tp_rank))
        pp_sent = self.pp_stats.bytes_sent if self.pp_stats is not None else 0
        stats.extra.update(dp_bytes_sent=stats.bytes_sent, pp_bytes_sent=pp_sent, tp_bytes_sent=tp_sent)
        if self.pp_stats is not None:
            stats.extra.update(bubble=self.pp_stats.bubble,
                               peak_activation_bytes=self.pp_stats.peak_activation_bytes)
        if self.num_experts:
            stats.extra["moe"] = routing(self.grid, self.moe, self.num_experts, len(microbatches))
            stats.extra["ep_bytes_sent"] = stats.extra["moe"]["a2a_bytes"]
        stats.bytes_sent += pp_sent + tp_sent + stats.extra.get("ep_bytes_sent", 0)
        return stats

    def serve(self, rounds: int | None = None) -> None:
        raise PsrtError("a grid has no dedicated server ranks")

    def finish(self) -> None:
        for c in self.components:
            c.finish()

    # ------------------------------------------------------------------ the whole model
    def whole(self, root: int = 0) -> nn.Module | None:
        """The one-process model with the trained parameters, assembled on grid rank `root`
        from every (pp, tp) shard of dp replica 0 and the experts of its expert-parallel
        group (None on the other ranks).  Collective over the grid."""
        g = self.grid
        pieces = []
        if g.dp_rank < g.ep:
            for p in self.params:
                if g.dp_rank > 0 and id(p) not in self.expert_ids:
                    continue
                dense_name, dim, index = self.specs[self.names[id(p)]]
                pieces.append((dense_name, dim, None if index is None else index.tolist(), p.detach().cpu()))
        gathered = g.cart_comm.gather(pieces, root=root)
        if gathered is None:
            return None
        state = dict(self.dense.state_dict())
        for dense_name, dim, index, t in (x for part in gathered for x in part):
            if dim is None:
                state[dense_name] = t
            else:
                state[dense_name] = state[dense_name].clone().index_copy_(dim, torch.tensor(index), t)
        self.dense.load_state_dict(state)
        return self.dense

    def label(self, dp: str) -> str:
        g = self.grid
        return f"{dp} dp{g.dp}xpp{g.pp}xtp{g.tp}" + (f" ep{g.ep}" if self.num_experts else "")

    def params_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def bytes_sent(self) -> int:
        return 0

    def free(self) -> None:
        self.grid.free()


def attach(grid, model: nn.Module, params: list, expert_ids: set, dp: str, options: dict, make_optimizer) -> list:
    """The data-parallel components of this rank's parameters: strategy `dp` over the grid's
    dp group; with experts spread over ep > 1 ranks, its dense parameters there and its
    experts' over the expert-data-parallel group (each with its own optimizer)."""
    cls = strategy_class(dp)
    experts = [p for p in params if id(p) in expert_ids]
    if grid.ep == 1 or not experts:
        return [cls(model, make_optimizer, grid.dp_group, params=params, **options)]
    # An expert's gradient on its rank already sums the contributions of the tokens of every
    # rank of its expert-parallel group; the components average over their group (edp: dp /
    # ep ranks), so a factor 1/ep more gives the global batch's mean.
    for p in experts:
        p.register_hook(lambda grad: grad / grid.ep)
    return [cls(model, make_optimizer, grid.dp_group, params=[p for p in params if id(p) not in expert_ids],
                **options),
            cls(model, make_optimizer, grid.edp_group, params=experts, **options)]


def begin_moe_step(grid, layers: list, microbatches: int, scaler=None) -> None:
    """Before a step's passes: each micro-batch's balance loss, backpropagated with it,
    weighs dp/n: the dense gradients are averaged over dp and a layer's balance loss is this
    rank's share of the global one (psrt.ep.layer.AttachAux; fp16: scaled as the loss is)."""
    from psrt.ep.layer import begin_step
    begin_step(layers, grid.dp / microbatches * (scaler.scale if scaler else 1.0))


def routing(grid, layers: list, num_experts: int, microbatches: int) -> dict:
    """The MoE figures of a step, the same on every rank: routed and dropped per expert
    summed over every layer of the model, the global balance loss (its mean over the
    micro-batches, as the loss), the number of MoE layers, and a2a_bytes, what this rank sent
    in its layers' all-to-alls.  One all-reduce over the grid: each layer's figures are
    already summed over dp and stand on each of its stage's dp x tp ranks, its balance-loss
    shares on each of its tp ranks."""
    from psrt.ep.layer import tally
    g, E = grid, num_experts
    mine = tally(layers)
    local_ = torch.zeros(2 * E + 2, dtype=torch.float64)
    if mine["layers"]:
        local_[:E], local_[E:2 * E] = mine["routed"], mine["dropped"]
    local_[2 * E:] = torch.tensor([mine["aux"] / microbatches * g.dp, mine["layers"]])
    total = g.cart_comm.allreduce(local_) / (g.dp * g.tp)
    return {"routed": total[:E], "dropped": total[E:2 * E], "aux_loss": float(total[2 * E]),
            "layers": round(float(total[2 * E + 1])), "a2a_bytes": mine["a2a_bytes"]}


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


class GridState:
    """What a checkpoint saves of a grid rank: each component's state (model slice,
    optimizer or its shard, the server's shard) and the rank's place in the grid.  A run
    resumes on another data-parallel degree: each rank takes the states of the old ranks at
    its own (pp, tp) place, in dp order, and each component loads them (a replica's, or its
    shards resharded; the experts' groups change with dp, so --model moe resumes on the same
    degree only)."""

    def __init__(self, layout: OnGrid):
        self.layout = layout
        self.worker_rank = layout.grid.rank

    @property
    def reshardable(self) -> bool:
        return not self.layout.num_experts and all(getattr(c, "reshardable", False)
                                                   for c in self.layout.components)

    def state_dict(self) -> dict:
        g = self.layout.grid
        return {"components": [c.state_dict() for c in self.layout.components],
                "place": [g.dp_rank, g.pp_rank, g.tp_rank]}

    def load_state_dict(self, state: dict) -> None:
        g = self.layout.grid
        if list(state["place"]) != [g.dp_rank, g.pp_rank, g.tp_rank]:
            raise PsrtError(f"--resume: rank {g.rank} held dp/pp/tp place {state['place']} in the "
                            f"checkpoint, {[g.dp_rank, g.pp_rank, g.tp_rank]} now", everywhere=True)
        for c, s in zip(self.layout.components, state["components"]):
            c.load_state_dict(s)

    def load_resharded(self, states: list[dict]) -> None:
        g = self.layout.grid
        if not self.reshardable:
            raise PsrtError("--resume on another number of ranks: --model moe resumes on the same "
                            "data-parallel degree only (its expert groups change with it), and ps "
                            "with the same servers", everywhere=True)
        mine = sorted((s for s in states if list(s["place"][1:]) == [g.pp_rank, g.tp_rank]),
                      key=lambda s: s["place"][0])
        for i, c in enumerate(self.layout.components):
            c.load_resharded([s["components"][i] for s in mine])


# The layouts docs/how-to/training.md's table shows, as psrt.train's flags set them.
TABLE_LAYOUTS = (("whole model", {}), ("--pp 2", {"pp": 2}), ("--tp 2", {"tp": 2}),
                 ("--pp 2 --tp 2", {"pp": 2, "tp": 2}), ("--model moe --ep 2", {"moe": True, "ep": 2}))


def support_table() -> str:
    """The markdown table of which --dp trains in which layout, each "no" numbered with its
    reason below the table (docs/how-to/training.md holds it; a test keeps the two equal)."""
    from psrt.dp import STRATEGIES
    rows = ["| --dp | " + " | ".join(name for name, _ in TABLE_LAYOUTS) + " |",
            "|---" * (len(TABLE_LAYOUTS) + 1) + "|"]
    reasons: list[str] = []
    for dp in STRATEGIES:
        if dp == "zero":
            continue                       # zero1's earlier name
        cells = []
        for _, where in TABLE_LAYOUTS:
            why = refusal(dp, **where)
            if why is None:
                cells.append("yes")
                continue
            why = why.split(": ", 1)[1].replace(f"{dp} ", "it ", 1)
            if why not in reasons:
                reasons.append(why)
            cells.append(f"no ({reasons.index(why) + 1})")
        rows.append(f"| {dp} | " + " | ".join(cells) + " |")
    return "\n".join(rows + [""] + [f"{i}. {why}." for i, why in enumerate(reasons, 1)])
