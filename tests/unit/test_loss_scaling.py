"""psrt's loss scaler against PyTorch's GradScaler: the same scales, the same skipped steps and
the same parameters over a run with overflows; and the flags that select it."""
import pytest
import torch

from psrt.dp.precision import LossScaler, ScaledOptimizer, check
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


@pytest.mark.parametrize("argv,words", [
    ("--dp ps --precision fp16", "--precision fp16 with --dp ps: loss scaling needs every rank"),
    ("--dp horovod --precision fp16", "--precision fp16 with --dp horovod"),
])
def test_where_fp16_cannot_go_is_one_line(argv, words):
    with pytest.raises(PsrtError) as err:
        check_strategies(parse_args(argv.split()))
    assert str(err.value).startswith(words), str(err.value)


def test_a_hybrid_or_moe_run_takes_fp16_whatever_its_dp_axis_reduces_with():
    # every rank steps the optimizer there: --dp only names the all-reduce algorithm
    check_strategies(parse_args("--model transformer --pp 2 --dp ps --precision fp16".split()))
    check_strategies(parse_args("--model moe --dp ps --precision fp16".split()))
    check_strategies(parse_args("--model moe --pp 2 --dp ps --precision fp16".split()))


def test_bf16_goes_everywhere_data_parallel():
    for dp in ("ps", "ps-async", "horovod", "ring", "zero3"):
        check("bf16", dp)
