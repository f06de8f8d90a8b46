"""The training configuration and its generated command line (in process, no MPI)."""
import dataclasses

import pytest

from psrt.errors import PsrtError
from psrt.train.config import TrainConfig, build_parser, flag, parse_args


def test_every_field_is_a_flag_with_help():
    parser = build_parser()
    text = parser.format_help()
    for f in dataclasses.fields(TrainConfig):
        assert flag(f.name) in text, flag(f.name)
        assert f.metadata["help"].split()[0] in text


def test_defaults_train_out_of_the_box():
    cfg = parse_args([])
    assert (cfg.dp_list, cfg.model, cfg.data, cfg.optimizer, cfg.lr) == (["ring"], "mlp", "digits", "sgd", 0.1)
    assert parse_args(["--model", "transformer"]).data == "text"
    assert parse_args(["--optimizer", "adam"]).lr == pytest.approx(3e-3)


def test_comma_list_of_strategies():
    cfg = parse_args(["--dp", "ps,ring"])
    assert cfg.dp_list == ["ps", "ring"]
    assert cfg.path_for("out/m.jsonl", "ps") == "out/m.ps.jsonl"
    assert cfg.path_for("ckpt", "ring") == "ckpt.ring"
    assert parse_args(["--dp", "zero"]).path_for("m.jsonl", "zero") == "m.jsonl"


@pytest.mark.parametrize("argv,words", [
    (["--dp", "ring,bogus"], "--dp 'bogus'"),
    (["--dp", "ring,ring"], "listed twice"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--accum", "-1"], "--accum -1"),
    (["--lr", "-0.1"], "--lr -0.1"),
    (["--bucket-mb", "0"], "--bucket-mb 0"),
    (["--steps", "x"], "--steps: invalid int value"),
    (["--model", "resnet"], "--model: invalid choice"),
    (["--compress", "int8"], "--compress: invalid choice"),
    (["--model", "mlp", "--data", "text"], "--model mlp cannot train on --data text"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_input_is_one_line_naming_the_flag(argv, words):
    with pytest.raises(PsrtError) as err:
        parse_args(argv)
    assert words in str(err.value)
    assert "\n" not in str(err.value)
    assert err.value.everywhere            # every rank fails alike: only rank 0 prints it


def test_config_checks_hold_without_the_parser():
    with pytest.raises(PsrtError, match="--batch-size"):
        TrainConfig(batch_size=-4)
