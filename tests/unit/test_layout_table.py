"""Which --dp trains in which layout: the table the docs show is the one the code refuses by."""
from pathlib import Path

import pytest

from psrt.train.config import parse_args
from psrt.train.layout import refusal, support_table
from psrt.train.loop import check_strategies
from psrt.errors import PsrtError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "training.md"


def test_docs_training_holds_the_table_the_code_refuses_by():
    assert support_table() in DOCS.read_text()


@pytest.mark.parametrize("dp", ["ps", "ps-sharded", "ring", "native", "zero1", "zero2", "zero3", "ps-async",
                                "torch", "horovod"])
def test_every_strategy_trains_on_the_whole_model(dp):
    assert refusal(dp) is None


@pytest.mark.parametrize("argv,words", [
    ("--model transformer --pp 2 --dp zero3", "zero3 would gather every unit again"),
    ("--model transformer --tp 2 --sequence-parallel --dp zero3", "summed over the TP group after backward"),
    ("--model moe --ep 2 --dp zero3", "shards whole modules over one group"),
    ("--model transformer --pp 2 --dp ps-async", "no rank is left to serve"),
    ("--model transformer --tp 2 --dp horovod", "its own world communicator"),
    ("--model transformer --tp 2 --dp torch", "use ring or native"),
    ("--model transformer --tp 2 --dp ps --servers 1", "every rank of a grid holds a stage or shard"),
    ("--model moe --ep 2 --dp ps-sharded --precision fp16", "one overflow decision"),
])
def test_a_refused_pair_is_one_line_before_training(argv, words):
    with pytest.raises(PsrtError) as err:
        check_strategies(parse_args(argv.split()))
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("argv", [
    "--model transformer --pp 2 --tp 2 --dp zero1", "--model transformer --pp 2 --dp zero2 --bucket-mb 1",
    "--model transformer --tp 2 --dp zero3", "--model transformer --pp 2 --dp ps,ps-sharded",
    "--model moe --ep 2 --dp ring,native,zero1,zero2,ps,ps-sharded", "--model moe --tp 2 --dp zero3",
    "--model transformer --tp 2 --dp zero1 --offload-optimizer --compress bf16",
])
def test_the_composed_pairs_are_accepted(argv):
    check_strategies(parse_args(argv.split()))
