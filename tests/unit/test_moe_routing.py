"""Top-k routing, capacity and the load-balancing loss (psrt/ep/routing.py, psrt/ep/layer.py)
against cases worked out by hand: which expert, which gate weight, which place in the
expert's buffer, which choices are dropped, and alpha E sum_i f_i P_i (Switch Transformer,
Fedus et al. 2021, eq. 4)."""
import math

import pytest
import torch

from psrt.ep.layer import MoELayer
from psrt.ep.routing import balance_loss, balance_terms, capacity, route

# top-1: 4 tokens over 2 experts; expert 0 is the first choice of tokens 0, 1 and 3
TOP1 = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], dtype=torch.float64)
# top-2: 3 tokens over 3 experts
TOP2 = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.7, 0.1]], dtype=torch.float64)


def test_capacity_is_the_ceiling_of_c_t_k_over_e():
    assert capacity(4, 1, 2, 1.0) == 2
    assert capacity(3, 2, 3, 1.0) == 2
    assert capacity(10, 2, 4, 1.25) == math.ceil(6.25) == 7
    assert capacity(1, 1, 8, 0.1) == 1            # never below one place


def test_top1_switch_routing_and_capacity():
    r = route(TOP1, k=1, factor=1.0)
    assert r.capacity == 2                        # ceil(1.0 x 4 x 1 / 2)
    assert r.expert.tolist() == [[0], [0], [1], [0]]
    # Switch: the gate weight is the chosen expert's probability, not renormalised to 1
    assert torch.allclose(r.gate, torch.tensor([[0.9], [0.8], [0.7], [0.6]], dtype=torch.float64))
    # expert 0 fills its 2 places with tokens 0 and 1, in token order; token 3 is dropped
    assert r.position.tolist() == [[0], [1], [0], [2]]
    assert r.keep.tolist() == [[True], [True], [True], [False]]
    assert r.dropped == 1
    assert route(TOP1, k=1, factor=2.0).dropped == 0


def test_top2_gshard_renormalises_and_fills_first_choices_first():
    r = route(TOP2, k=2, factor=1.0)
    assert r.capacity == 2                        # ceil(1.0 x 3 x 2 / 3)
    assert r.expert.tolist() == [[0, 1], [1, 2], [1, 0]]
    # GShard: the two probabilities renormalised to sum to 1
    want = torch.tensor([[5 / 8, 3 / 8], [2 / 3, 1 / 3], [7 / 9, 2 / 9]], dtype=torch.float64)
    assert torch.allclose(r.gate, want)
    # first choices take places before any second choice: expert 1 holds the first choices of
    # tokens 1 and 2, so token 0's second choice (expert 1) finds it full.  Token-major
    # filling would have dropped token 2's FIRST choice instead.
    assert r.position.tolist() == [[0, 2], [0, 0], [1, 1]]
    assert r.keep.tolist() == [[True, False], [True, True], [True, True]]
    assert r.dropped == 1


def test_token_groups_have_a_capacity_each():
    probs = torch.tensor([[0.9, 0.1]] * 4, dtype=torch.float64)     # every token wants expert 0
    whole = route(probs, k=1, factor=1.0)
    assert whole.capacity == 2 and whole.keep[:, 0].tolist() == [True, True, False, False]
    grouped = route(probs, k=1, factor=1.0, groups=2)               # two ranks of 2 tokens
    assert grouped.capacity == 1 and grouped.keep[:, 0].tolist() == [True, False, True, False]
    assert grouped.position[:, 0].tolist() == [0, 1, 0, 1]


def test_balance_terms_count_first_choices_and_sum_probabilities():
    r = route(TOP2, k=2, factor=1.0)
    counts, psum = balance_terms(TOP2, r.expert, 3)
    assert counts.tolist() == [1, 2, 0]           # first choices only, dropped or not
    assert torch.allclose(psum, torch.tensor([0.8, 1.6, 0.6], dtype=torch.float64))


@pytest.mark.parametrize("probs,k,want", [
    # f = (3/4, 1/4), P = (0.65, 0.35): 2 (0.75 x 0.65 + 0.25 x 0.35) = 1.15
    (TOP1, 1, 1.15),
    # f = (1/3, 2/3, 0), P = (0.8, 1.6, 0.6) / 3: 3 (0.8 / 9 + 3.2 / 9) = 4/3
    (TOP2, 2, 4 / 3),
    # uniform routing is the minimum, alpha itself
    (torch.tensor([[0.7, 0.3], [0.3, 0.7]], dtype=torch.float64), 1, 1.0),
])
def test_balance_loss_is_alpha_e_sum_f_p(probs, k, want):
    alpha = 0.01
    r = route(probs, k=k, factor=1.0)
    counts, psum = balance_terms(probs, r.expert, probs.shape[1])
    assert float(balance_loss(counts, psum, len(probs), alpha)) == pytest.approx(alpha * want, rel=1e-12)
    # two ranks' shares (their probability sums, the global f and token count) add up to it
    half = len(probs) // 2
    shares = [balance_loss(counts, probs[s].sum(0), len(probs), alpha) for s in (slice(0, half), slice(half, None))]
    assert float(sum(shares)) == pytest.approx(alpha * want, rel=1e-12)


def test_balance_loss_gradient_is_alpha_e_f_over_t():
    counts = torch.tensor([3.0, 1.0], dtype=torch.float64)
    psum = TOP1.sum(0).clone().requires_grad_()
    balance_loss(counts, psum, 4, 0.01).backward()
    assert torch.allclose(psum.grad, 0.01 * 2 * (counts / 4) / 4)


def layer_on(probs: torch.Tensor, k: int, factor: float, alpha: float = 0.01) -> MoELayer:
    """A layer whose gate turns input row log(p) into probabilities p (gate = identity)."""
    torch.manual_seed(0)
    E = probs.shape[1]
    layer = MoELayer(E, 8, experts=E, top_k=k, capacity_factor=factor, aux_alpha=alpha).double()
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(E, dtype=torch.float64))
    return layer


@pytest.mark.parametrize("probs,k,aux,dropped", [(TOP1, 1, 1.15, [1, 0]), (TOP2, 2, 4 / 3, [0, 1, 0])])
def test_the_layer_counts_drops_and_adds_the_balance_loss(probs, k, aux, dropped):
    layer = layer_on(probs, k, 1.0)
    x = probs.log()
    y = layer(x)
    assert float(layer.aux.detach()) == pytest.approx(0.01 * aux, rel=1e-6)     # the gate's softmax is fp32
    assert layer.stats["dropped"].tolist() == dropped          # per expert
    assert layer.stats["routed"].sum() == k * len(probs) and layer.stats["tokens"] == len(probs)
    # each token's output: its kept experts' outputs times their gate weights
    r = route(probs, k, 1.0)
    want = torch.zeros_like(x)
    for t in range(len(x)):
        for s in range(k):
            if r.keep[t, s]:
                want[t] += r.gate[t, s] * layer.experts[int(r.expert[t, s])](x[t:t + 1])[0]
    assert torch.allclose(y, want)
    # the tally keeps the figures of recorded forwards only
    tally = layer.tally
    assert tally["dropped"].tolist() == dropped and tally["aux"] == pytest.approx(0.01 * aux, rel=1e-6)
    with torch.no_grad():
        layer(x)
    assert layer.tally["dropped"].tolist() == dropped
