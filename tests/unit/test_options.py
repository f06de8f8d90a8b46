"""Strict options: a strategy, the hybrid trainer's config or the training CLI that is given an
option it does not understand refuses it in one line naming what it accepts."""
import dataclasses

import pytest
import torch

from psrt.dp import STRATEGIES, strategy_class
from psrt.dp.base import option_names
from psrt.errors import PsrtError
from psrt.train.config import STRATEGY_FLAGS, TrainConfig, parse_args
from psrt.train.hybrid import HybridConfig
from psrt.train.loop import check_strategies, strategy_options

# One misspelling per strategy, of an option it (or its family) really has.
MISSPELT = {"ps": "server", "ps-sharded": "shard", "ps-async": "stalenes", "ring": "bucket_m",
            "native": "overlapp", "torch": "algorithms", "zero": "compres", "horovod": "compression",
            "zero1": "compres", "zero2": "bucket_m", "zero3": "overlapp"}


def test_every_strategy_has_a_misspelling_here():
    assert set(MISSPELT) == set(STRATEGIES)


@pytest.mark.parametrize("dp", sorted(STRATEGIES))
def test_a_misspelt_option_is_refused_naming_what_is_accepted(dp):
    cls = strategy_class(dp)
    with pytest.raises(PsrtError) as err:
        cls(torch.nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), None, **{MISSPELT[dp]: 1})
    message = str(err.value)
    assert message.startswith(f"--dp {dp}: unknown option {MISSPELT[dp]} (it accepts ")
    assert all(name in message for name in option_names(cls)) and "\n" not in message


def test_options_are_typed_and_checked_where_they_are_declared():
    ring = strategy_class("ring")
    assert option_names(ring) == ("bucket_mb", "overlap", "compress", "algorithm")
    with pytest.raises(PsrtError, match="--bucket-mb 0: must be positive"):
        ring.Options(bucket_mb=0)
    with pytest.raises(PsrtError, match="--compress 'bf16': horovod offers none, fp16"):
        strategy_class("horovod").Options(compress="bf16")


@pytest.mark.parametrize("dp", sorted(STRATEGIES))
def test_the_cli_passes_each_strategy_only_its_own_options(dp):
    cfg = TrainConfig(dp=dp)
    assert set(strategy_options(cfg, dp)) <= set(option_names(strategy_class(dp)))
    assert set(option_names(strategy_class(dp))) <= set(f.name for f in dataclasses.fields(TrainConfig)) | \
        {"timeout_s", "shards", "record_clocks"}


@pytest.mark.parametrize("argv,words", [
    ("--dp ring --servers 1", "--servers does not apply to --dp ring: it is an option of ps, ps-sharded, ps-async"),
    ("--dp ps --bucket-mb 4", "--bucket-mb does not apply to --dp ps"),
    ("--dp horovod --algorithm ring", "--algorithm does not apply to --dp horovod"),
    ("--dp ring --pp 2 --model transformer --servers 1", "--servers does not apply to --dp ring: it is an option of"),
    ("--dp ps --model moe --no-overlap", "--overlap does not apply to --dp ps"),
    # every rank of a grid holds a part of the model: no rank is left to serve alone
    ("--dp ps --model moe --servers 1", "--servers 1 with --model moe: every rank of a grid holds a stage or shard"),
])
def test_a_flag_no_chosen_strategy_takes_is_refused_before_training(argv, words):
    with pytest.raises(PsrtError) as err:
        check_strategies(parse_args(argv.split()))
    assert str(err.value).startswith(words), str(err.value)


@pytest.mark.parametrize("argv", ["--dp ps,ring --servers 1", "--dp ring --bucket-mb 4", "--dp ring,zero --compress fp16",
                                  "--dp ps-async --staleness 2 --servers 1", "--dp ring --pp 2 --model transformer --algorithm ps",
                                  "--dp ring --model moe --algorithm tree",
                                  # a strategy's flags work in every layout it trains in
                                  "--dp ring --model moe --compress fp16 --bucket-mb 4",
                                  "--dp ring --model moe --pp 2 --compress fp16",
                                  "--dp zero2 --model transformer --pp 2 --bucket-mb 1"])
def test_flags_that_apply_to_one_chosen_strategy_pass(argv):
    check_strategies(parse_args(argv.split()))


def test_every_strategy_flag_is_an_option_of_some_strategy():
    taken = {name for dp in STRATEGIES for name in option_names(strategy_class(dp))}
    assert set(STRATEGY_FLAGS) <= taken


def test_hybrid_config_refuses_an_unknown_option():
    with pytest.raises(PsrtError, match=r"^HybridConfig: unknown option microbatch \(it accepts vocab, "):
        HybridConfig.make(microbatch=4)
    assert HybridConfig.make(microbatches=4).microbatches == 4


def test_the_option_table_is_the_strategies_own_options():
    """psrt.dp.OPTION_TAKERS (read before torch loads, the help text's source) says what the
    strategies' Options dataclasses say."""
    from psrt.dp import OPTION_TAKERS, STRATEGIES
    from psrt.train.loop import takers
    assert OPTION_TAKERS == {name: tuple(takers(name)) for name in OPTION_TAKERS}
    from psrt.train.config import build_parser
    text = " ".join(build_parser().format_help().split())
    assert "whichever is smaller); --dp ring, native, torch, zero2" in text and "--dp zero1, zero2, zero3" in text
    assert set(STRATEGIES) >= {d for ds in OPTION_TAKERS.values() for d in ds}


def test_backup_workers_is_offered_only_where_it_works():
    """ps-sharded's shards are several servers, which backup workers cannot have: its help
    and its options leave --backup-workers out, and asking for it names ps in one line."""
    from psrt.errors import PsrtError
    from psrt.train.config import build_parser, parse_args
    from psrt.train.loop import check_strategies
    action = next(a for a in build_parser()._actions if "--backup-workers" in a.option_strings)
    assert action.help.rstrip().endswith("--dp ps"), action.help
    with pytest.raises(PsrtError, match="--backup-workers does not apply to --dp ps-sharded: it is an option of ps$"):
        check_strategies(parse_args("--dp ps-sharded --backup-workers 1".split()))
