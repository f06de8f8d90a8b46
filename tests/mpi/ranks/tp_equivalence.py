"""Rank side of tests/mpi/test_tensor_parallel.py: TP layers and the TP transformer against the
dense modules, computed whole in this process with the same weights and inputs.

Sizes are deliberately not divisible by the number of ranks where the layer allows it
(7 output features, 5 input features, a vocabulary of 11) so uneven shards are covered.
Communication is counted through CountingGroup to check Megatron-LM's count: per
transformer block two all-reduces of b*s*h values forward and two backward.  Prints one
PSRT-RESULT line per check and rank.
"""
import copy
import json

import torch
import torch.nn.functional as F
from torch import nn

import psrt
from psrt.collectives.layout import shard_range
from psrt.train.models import TransformerLM
from psrt.tp import (ColumnParallelLinear, CountingGroup, ParallelAttention, RowParallelLinear,
                     VocabParallelEmbedding, shard_dense, shard_specs, take,
                     vocab_parallel_cross_entropy)
from psrt.tp.attention import head_rows
from psrt.tp.comm import reduce_sequence_parallel_grads

RTOL, ATOL = 1e-5, 4e-5


def close(name, got, want, out):
    if got.shape != want.shape:
        out.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        out.append(f"{name}: max diff {(got - want).abs().max().item()}")


def rows(n, g):
    return slice(*shard_range(n, g.size, g.rank))


def check_linear(g, errs):
    torch.manual_seed(1)
    dense = nn.Linear(6, 7)
    x = torch.randn(3, 4, 6, requires_grad=True)
    col = ColumnParallelLinear.from_dense(dense, g, gather_output=True)
    xc = x.detach().clone().requires_grad_()
    (col(xc) * torch.arange(7.0)).sum().backward()
    (dense(x) * torch.arange(7.0)).sum().backward()
    close("column out", col(xc), dense(x), errs)
    close("column dx", xc.grad, x.grad, errs)
    close("column dW", col.weight.grad, dense.weight.grad[rows(7, g)], errs)
    close("column db", col.bias.grad, dense.bias.grad[rows(7, g)], errs)

    dense = nn.Linear(5, 3)
    x = torch.randn(2, 5, requires_grad=True)
    row = RowParallelLinear.from_dense(dense, g, input_is_parallel=False)
    xr = x.detach().clone().requires_grad_()
    (row(xr) ** 2).sum().backward()
    (dense(x) ** 2).sum().backward()
    close("row out", row(xr), dense(x), errs)
    close("row dx", xr.grad, x.grad, errs)
    close("row dW", row.weight.grad, dense.weight.grad[:, rows(5, g)], errs)
    close("row db", row.bias.grad, dense.bias.grad, errs)


def check_embedding_and_loss(g, errs):
    torch.manual_seed(2)
    emb = nn.Embedding(11, 4)
    ids = torch.tensor([[0, 5, 10, 3], [7, 7, 1, 9]])
    par = VocabParallelEmbedding.from_dense(emb, g)
    (par(ids) * torch.linspace(-1, 1, 4)).sum().backward()
    (emb(ids) * torch.linspace(-1, 1, 4)).sum().backward()
    close("embedding out", par(ids), emb(ids), errs)
    close("embedding dW", par.weight.grad, emb.weight.grad[rows(11, g)], errs)

    logits = (torch.randn(2, 4, 11) * 5).requires_grad_()
    target = torch.randint(0, 11, (2, 4))
    local = logits.detach()[..., rows(11, g)].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, g, 11)
    want = F.cross_entropy(logits.reshape(-1, 11), target.reshape(-1))
    loss.backward()
    want.backward()
    close("vocab CE loss", loss.detach(), want.detach(), errs)
    close("vocab CE dlogits", local.grad, logits.grad[..., rows(11, g)], errs)


def check_attention(g, errs):
    torch.manual_seed(3)
    dim, heads = 8, 4
    qkv, proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
    x = torch.randn(2, 5, dim, requires_grad=True)

    def dense(x):
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, heads, dim // heads).transpose(1, 2) for z in qkv(x).split(dim, 2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return proj(a.transpose(1, 2).reshape(b, s, dim))
    attn = ParallelAttention.from_dense(qkv, proj, heads, g)
    xa = x.detach().clone().requires_grad_()
    (attn(xa) ** 2).sum().backward()
    (dense(x) ** 2).sum().backward()
    close("attention out", attn(xa), dense(x), errs)
    close("attention dx", xa.grad, x.grad, errs)
    r = head_rows(dim, heads, g.size, g.rank)
    close("attention dWqkv", attn.qkv.weight.grad, qkv.weight.grad[r], errs)
    close("attention dWproj", attn.proj.weight.grad, proj.weight.grad[:, r[:dim // g.size]], errs)


def check_lm(g, errs, counts):
    """shard_dense(TransformerLM) vs the dense model: loss, every gradient, and the
    all-reduce count of one block (forward and backward)."""
    torch.manual_seed(4)
    b, s, h, vocab = 3, 8, 16, 12
    dense = TransformerLM(vocab=vocab, dim=h, layers=2, heads=4, max_len=s)
    counter = CountingGroup(g)
    model = shard_dense(copy.deepcopy(dense), counter)
    x, y = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))
    want = F.cross_entropy(dense(x).reshape(-1, vocab), y.reshape(-1))
    want.backward()
    loss = model.loss(model(x), y)
    loss.backward()
    close("lm loss", loss.detach(), want.detach(), errs)
    specs, params = shard_specs(model), dict(dense.named_parameters())
    for name, p in model.named_parameters():
        close(f"lm grad {name}", p.grad, take(specs[name], params[specs[name][0]].grad), errs)
    # One block in isolation: forward, then backward, counted separately.
    block = model.blocks[0]
    hid = torch.randn(b, s, h, requires_grad=True)
    counter.reset()
    out = block(hid)
    counts["forward"] = (dict(counter.calls), dict(counter.bytes))
    counter.reset()
    out.sum().backward()
    counts["backward"] = (dict(counter.calls), dict(counter.bytes))
    counts["bsh_bytes"] = b * s * h * 4
    return loss.item()


def check_sequence_parallel(g, errs, counts):
    """The TP transformer with sequence parallelism vs the dense model (a sequence of 7, so the
    slices are uneven at TP 2): loss, every gradient once the LayerNorm and row-bias gradients
    are summed over the TP group, and one block's collectives: two all-gathers (f-bar) and
    two reduce-scatters (g-bar) forward, the same backward."""
    torch.manual_seed(5)
    b, s, h, vocab = 3, 7, 16, 12
    dense = TransformerLM(vocab=vocab, dim=h, layers=2, heads=4, max_len=s)
    counter = CountingGroup(g)
    model = shard_dense(copy.deepcopy(dense), counter, sequence_parallel=True)
    x, y = torch.randint(0, vocab, (b, s)), torch.randint(0, vocab, (b, s))
    want = F.cross_entropy(dense(x).reshape(-1, vocab), y.reshape(-1))
    want.backward()
    loss = model.loss(model(x), y)
    loss.backward()
    reduce_sequence_parallel_grads(list(model.parameters()), g)
    close("sp loss", loss.detach(), want.detach(), errs)
    specs, params = shard_specs(model), dict(dense.named_parameters())
    for name, p in model.named_parameters():
        close(f"sp grad {name}", p.grad, take(specs[name], params[specs[name][0]].grad), errs)
    block = model.blocks[0]
    local = s // g.size if s % g.size == 0 else len(range(*shard_range(s, g.size, g.rank)))
    hid = torch.randn(b, local, h, requires_grad=True)
    counter.reset()
    out = block(hid)
    counts["sp_forward"] = dict(counter.calls)
    counter.reset()
    out.sum().backward()
    counts["sp_backward"] = dict(counter.calls)
    return loss.item()


def main():
    world = psrt.init()
    out = []
    for tp in (1, world.size):
        comm = world.comm.Split(color=world.rank // tp, key=world.rank)
        g = psrt.Communicator(comm)
        errs, counts = [], {}
        check_linear(g, errs)
        check_embedding_and_loss(g, errs)
        check_attention(g, errs)
        loss = check_lm(g, errs, counts)
        sp_loss = check_sequence_parallel(g, errs, counts)
        out.append({"rank": world.rank, "tp": tp, "errors": errs, "lm_loss": loss, "sp_loss": sp_loss,
                    "counts": counts})
        g.close()
        comm.Free()
    for rec in out:
        print("PSRT-RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
