"""psrt's loss scaler against PyTorch's GradScaler: the same scales, the same skipped steps and
the same parameters over a run with overflows; and the flags that select it."""
import pytest
import torch

from psrt.dp.precision import LossScaler, ScaledOptimizer, check, scaled_factory, split
from psrt.errors import PsrtError
from psrt.train.config import parse_args
from psrt.train.loop import check_strategies

POISON = {2, 3, 9}           # steps whose gradients get an inf


def _run(use_torch: bool):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    opt = torch.optim.SGD([p], lr=0.01, momentum=0.9)
    if use_torch:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=3)
    else:
        scaler = LossScaler(None, growth_interval=3)
        opt = ScaledOptimizer(opt, scaler)
    scales = []
    for step in range(14):
        opt.zero_grad()
        loss = (p * torch.arange(6.0)).pow(2).sum()
        (scaler.scale(loss) if use_torch else scaler(loss)).backward()
        if step in POISON:
            p.grad[1] = float("inf")
        if use_torch:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
            scales.append(scaler.scale)
    return scales, p.detach().clone()


def test_the_same_scales_skips_and_parameters_as_torch_gradscaler():
    ours, p_ours = _run(False)
    theirs, p_theirs = _run(True)
    assert ours == theirs
    assert torch.equal(p_ours, p_theirs)


def test_the_loss_keeps_its_value_and_only_its_gradient_is_scaled():
    scaler = LossScaler(None, init_scale=8.0)
    x = torch.tensor([3.0], requires_grad=True)
    y = scaler((x * 2).sum())
    assert y.item() == 6.0
    y.backward()
    assert x.grad.item() == 16.0


def test_every_data_parallel_strategy_takes_fp16_and_a_wrong_name_is_one_line():
    # the parameter servers agree on overflow in their protocol, Horovod wraps the scaled step
    check_strategies(parse_args("--dp ring,zero1,zero2,zero3,ps,ps-sharded,ps-async,horovod --precision fp16".split()))
    with pytest.raises(PsrtError) as err:
        check("fp8")
    assert str(err.value).startswith("--precision 'fp8': choose one of fp32, bf16, fp16"), str(err.value)


def test_a_hybrid_or_moe_run_takes_fp16_where_one_decision_covers_the_step():
    # one component on the dp axis: its servers (ps) or its optimizer decide for the step
    check_strategies(parse_args("--model transformer --pp 2 --dp ps --precision fp16".split()))
    check_strategies(parse_args("--model moe --dp ps --precision fp16".split()))
    check_strategies(parse_args("--model moe --pp 2 --dp ps --precision fp16".split()))
    # dense over dp and experts over edp: the ring and zero1 agree ahead on local gradients
    check_strategies(parse_args("--model moe --ep 2 --dp ring,zero1 --precision fp16".split()))
    for dp in ("ps", "ps-sharded", "zero2"):
        with pytest.raises(PsrtError, match="one overflow decision"):
            check_strategies(parse_args(f"--model moe --ep 2 --dp {dp} --precision fp16".split()))


def test_a_stale_overflow_skips_without_halving_again():
    """ps-async's rule: an overflow computed at the present scale (or below) halves it; one
    computed at a larger, older scale only skips; growth counts from the last overflow."""
    scaler = LossScaler(None, init_scale=1024.0, growth_interval=2)
    scaler.update(True, at_scale=1024.0)
    assert (scaler.scale, scaler.skipped, scaler.good_steps) == (512.0, 1, 0)
    scaler.update(True, at_scale=1024.0)            # computed before the halving: skip only
    assert (scaler.scale, scaler.skipped) == (512.0, 2)
    scaler.update(True, at_scale=256.0)             # overflows even at a smaller scale
    assert (scaler.scale, scaler.skipped) == (256.0, 3)
    scaler.update(False)
    scaler.update(False)
    assert (scaler.scale, scaler.good_steps) == (512.0, 0)


def test_a_server_copy_and_a_follower_keep_the_scale_and_counters():
    scaler = LossScaler(None, init_scale=64.0, growth_interval=5)
    scaler.update(True)
    copy = scaler.clone()
    assert copy.comm is None and copy.state_dict() == scaler.state_dict() == {"scale": 32.0, "good_steps": 0,
                                                                              "skipped": 1}
    copy.update(True)
    assert scaler.scale == 32.0                      # the copy is its own
    follower = LossScaler(None)
    follower.follow(copy.scale, copy.skipped)
    assert (follower.scale, follower.skipped) == (16.0, 2)


def test_the_strategies_that_step_elsewhere_take_the_factory_apart():
    scaler = LossScaler(None)
    make = scaled_factory(lambda params: torch.optim.SGD(params, lr=0.1), scaler)
    p = torch.nn.Parameter(torch.zeros(2))
    assert isinstance(make([p]), ScaledOptimizer)
    plain, got = split(make)
    assert got is scaler and isinstance(plain([p]), torch.optim.SGD)
    assert split(plain) == (plain, None)
