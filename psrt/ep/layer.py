"""The MoE feed-forward layer, its experts spread over an expert-parallel group.

Forward of T tokens on one rank: gate and route (routing.py); dispatch every kept choice to
the rank holding its expert with an all-to-all; each local expert (a GELU MLP) runs on the
rows it received from every rank; a second all-to-all returns them; each token's output is
the gate-weighted sum of its experts' outputs (a dropped choice adds nothing: the block's
residual carries the token).  Backward runs the two all-to-alls in reverse: 4 per layer per
step, each about T x k x h x d x (EP-1)/EP bytes per rank under uniform routing.  Rows travel
in the compute dtype (d = 2 bytes under bf16/fp16 autocast): the experts would cast their
input to it anyway, so dispatching the fp32 residual stream would only double the traffic.

Two dispatch shapes:
- "variable" (default): per-expert counts are exchanged first, then exactly the kept rows
  travel (psrt's alltoallv, counts differ per rank and per step);
- "padded": every expert's buffer has `capacity` rows on every rank, filled or not, so every
  all-to-all block has the same size (GShard's and Switch's fixed-shape dispatch).

The load-balancing loss uses global-batch statistics: f_i and P_i are summed over every rank
that sees different tokens (`stats_group`, the data-parallel group) before they are
combined, so the loss and its gradient are those of one process on the whole batch.  (With
per-rank statistics, each rank would balance its own tokens: a different and noisier loss.)
`aux` holds this rank's share: summed over the ranks it is the global loss.

Trainers set `aux_grad`, the weight of the balance loss in this rank's objective: the layer
then attaches `aux` to its output (AttachAux), so backward through the output also reaches
the gate through the balance loss.  Nothing has to add the loss at the end: a pipeline stage
without the final loss backpropagates it, and a recomputed block (whose first forward ran
without autograd) rebuilds it with the rest (Megatron-LM's MoEAuxLossAutoScaler does the same).

`tally` sums the routing figures of the forwards that autograd records (one per micro-batch,
also under --recompute, whose first pass records nothing); trainers read and reset it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from psrt.ep.routing import balance_loss, balance_terms, route

DISPATCH = ("variable", "padded")


class AllToAll(torch.autograd.Function):
    """Rows to other ranks by counts; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts, algorithm):
        ctx.group, ctx.counts, ctx.algorithm = group, (send_counts, recv_counts), algorithm
        return group.alltoallv(x.contiguous(), send_counts, recv_counts, algorithm=algorithm)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        back = ctx.group.alltoallv(grad.contiguous(), recv_counts, send_counts, algorithm=ctx.algorithm)
        return back, None, None, None, None


class AttachAux(torch.autograd.Function):
    """y unchanged; backward also sends `weight` as the gradient of the scalar aux."""

    @staticmethod
    def forward(ctx, y, aux, weight):
        ctx.weight, ctx.aux_dtype = weight, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoELayer(nn.Module):
    """A drop-in for a transformer block's MLP: [..., dim] -> [..., dim].

    Built with all `experts` (the same seed on every rank gives the same ones); `shard`
    then keeps this rank's E/EP of them and names the groups."""

    def __init__(self, dim: int, hidden: int, experts: int = 4, top_k: int = 1, capacity_factor: float = 1.25,
                 aux_alpha: float = 0.01, dispatch: str = "variable"):
        super().__init__()
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.aux_alpha, self.dispatch = aux_alpha, dispatch
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.ep_group = self.stats_group = None
        self.algorithm = "native"
        self.first_expert = 0        # global index of this rank's first expert
        self.token_groups = 1        # a one-process reference of N ranks sets N (routing.route)
        self.aux_grad: float | None = None
        self.aux = torch.zeros(())
        self.stats: dict = {}
        self.reset_tally()

    def shard(self, ep_group, stats_group, algorithm: str = "native") -> None:
        """Keep the experts of this rank of `ep_group` (a psrt Communicator); `stats_group`
        spans every rank with different tokens (the data-parallel group)."""
        size, rank = ep_group.size, ep_group.rank
        local = self.num_experts // size
        self.experts = nn.ModuleList(list(self.experts)[rank * local:(rank + 1) * local])
        self.ep_group, self.stats_group, self.algorithm = ep_group, stats_group, algorithm
        self.first_expert = rank * local

    def reset_tally(self) -> None:
        E = self.num_experts
        self.tally = {"aux": 0.0, "a2a_bytes": 0,
                      "routed": torch.zeros(E, dtype=torch.float64), "dropped": torch.zeros(E, dtype=torch.float64)}

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_group is None else self.ep_group.size

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        r = route(probs, self.top_k, self.capacity_factor, self.token_groups)
        self._balance(probs, r)
        y = self._variable(x, r) if self.dispatch == "variable" else self._padded(x, r)
        if torch.is_grad_enabled():
            t = self.tally
            t["aux"] += float(self.aux.detach())
            t["a2a_bytes"] += self.stats.get("a2a_bytes", 0)
            t["routed"] += self.stats["routed"]
            t["dropped"] += self.stats["dropped"]
            if self.aux_grad is not None:
                y = AttachAux.apply(y, self.aux, self.aux_grad)
        return y.reshape(shape)

    # ------------------------------------------------------------------ load balance
    def _balance(self, probs: torch.Tensor, r) -> None:
        E = self.num_experts
        counts, psum = balance_terms(probs, r.expert, E)
        with torch.no_grad():
            routed = torch.bincount(r.expert.reshape(-1), minlength=E).to(torch.float64)
            dropped = torch.bincount(r.expert[~r.keep], minlength=E).to(torch.float64)
            local = torch.cat([counts.double().detach(), routed, dropped,
                               torch.tensor([float(len(probs))], dtype=torch.float64, device=probs.device)])
            total = local if self.stats_group is None else self.stats_group.allreduce(local)
        f_counts, routed, dropped, tokens = total[:E], total[E:2 * E], total[2 * E:3 * E], total[-1]
        # this rank's share of alpha E sum_i f_i P_i: f of every rank's tokens, this rank's part of P
        self.aux = balance_loss(f_counts, psum, tokens, self.aux_alpha)
        # the tallies live on the host, whatever device the tokens are on
        self.stats = {"routed": routed.cpu(), "dropped": dropped.cpu(), "tokens": int(tokens)}

    # ------------------------------------------------------------------ dispatch
    def _run(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each local expert on the rows whose id is its index; rows keep their order."""
        pieces, where = [], []
        for e, expert in enumerate(self.experts):
            idx = (ids == e).nonzero(as_tuple=True)[0]
            if len(idx):
                pieces.append(expert(rows[idx]))
                where.append(idx)
        if not pieces:
            return rows * 0
        out, idx = torch.cat(pieces), torch.cat(where)
        return out[torch.argsort(idx)]

    def _exchange(self, rows, send_counts, recv_counts):
        if self.ep_size == 1:
            return rows
        sent = sum(send_counts) - send_counts[self.ep_group.rank]      # rows to the other ranks
        self.stats["a2a_bytes"] = self.stats.get("a2a_bytes", 0) + sent * rows.shape[1] * rows.element_size()
        return AllToAll.apply(rows, self.ep_group, send_counts, recv_counts, self.algorithm)

    @staticmethod
    def _wire(x: torch.Tensor) -> torch.Tensor:
        """x in the dtype the experts compute in: autocast's where it is on."""
        kind = x.device.type
        return x.to(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else x

    def _variable(self, x: torch.Tensor, r) -> torch.Tensor:
        P, local = self.ep_size, len(self.experts)
        tok, slot = r.keep.nonzero(as_tuple=True)
        e = r.expert[tok, slot]
        order = torch.argsort(e, stable=True)
        tok, slot, e = tok[order], slot[order], e[order]
        per_expert = torch.bincount(e, minlength=self.num_experts)
        send_counts = per_expert.view(P, local).sum(1).tolist()
        # the counts first: row s of recv_pe = how many rows rank s sends to each local expert
        recv_pe = per_expert.view(P, local) if P == 1 else \
            self.ep_group.alltoallv(per_expert.view(P, local), [1] * P, [1] * P)
        recv_counts = recv_pe.sum(1).tolist()
        self.stats["received"] = recv_pe          # [source rank, local expert]: rows this forward
        self.stats["a2a_bytes"] = 0
        got = self._exchange(self._wire(x[tok]), send_counts, recv_counts)
        ids = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(P), recv_pe.reshape(-1))
        back = self._exchange(self._run(got, ids), recv_counts, send_counts)
        # under autocast the experts answer in the compute dtype; the residual stream keeps x's
        weight = r.gate[tok, slot].unsqueeze(-1).to(x.dtype)
        return x.new_zeros(x.shape).index_add(0, tok, back.to(x.dtype) * weight)

    def _padded(self, x: torch.Tensor, r) -> torch.Tensor:
        P, local, cap, G = self.ep_size, len(self.experts), r.capacity, self.token_groups
        if P > 1 and G > 1:
            raise ValueError("token_groups > 1 is for a one-process reference, not with expert parallelism")
        tok, slot = r.keep.nonzero(as_tuple=True)
        # buffer [G, E, cap]: each token group has its own capacity in every expert
        group = tok // (len(x) // G)
        place = (group * self.num_experts + r.expert[tok, slot]) * cap + r.position[tok, slot]
        rows = self._wire(x[tok])
        buf = rows.new_zeros(G * self.num_experts * cap, x.shape[-1]).index_put((place,), rows)
        counts = [local * cap] * P
        self.stats["a2a_bytes"] = 0
        got = self._exchange(buf, counts, counts)
        ids = torch.arange(local, device=x.device).repeat_interleave(cap).repeat(P * G)
        back = self._exchange(self._run(got, ids), counts, counts)
        weight = r.gate[tok, slot].unsqueeze(-1).to(x.dtype)
        return x.new_zeros(x.shape).index_add(0, tok, back[place].to(x.dtype) * weight)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def begin_step(layers: list[MoELayer], aux_grad: float) -> None:
    """Before a training step: reset the layers' tallies and set the weight of their balance
    loss in this rank's objective (attached to each layer's output in every forward)."""
    for m in layers:
        m.aux_grad = aux_grad
        m.reset_tally()


def tally(layers: list[MoELayer]) -> dict:
    """The routing figures of these MoE layers since their last reset, summed over the
    layers ("layers": how many; "a2a_bytes": what this rank sent in the all-to-alls, counted
    in the dtype the rows travel in: forward dispatch and combine, and their gradients the
    same way back in backward), and the tallies reset."""
    out = {"layers": 0, "aux": 0.0, "a2a_bytes": 0, "routed": None, "dropped": None}
    for m in layers:
        t = m.tally
        out["layers"] += 1
        out["aux"] += t["aux"]
        out["a2a_bytes"] += 2 * t["a2a_bytes"]
        for k in ("routed", "dropped"):
            out[k] = t[k].clone() if out[k] is None else out[k] + t[k]
        m.reset_tally()
    return out


def aux_loss(model: nn.Module) -> torch.Tensor:
    """This rank's share of every MoE layer's load-balancing loss."""
    layers = moe_layers(model)
    return sum((m.aux for m in layers), torch.zeros(()))
