"""The training configuration and its generated command line (in process, no MPI)."""
import dataclasses

import pytest

from psrt.errors import PsrtError
from psrt.train.config import TrainConfig, build_parser, check_paths, flag, parse_args, plan_batch


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


def test_own_model_and_data_are_import_paths_checked_without_importing_them():
    cfg = parse_args(["--model", "no_such_pkg.models:build_model", "--data", "no_such_pkg.data:Digits.build"])
    assert (cfg.model, cfg.data) == ("no_such_pkg.models:build_model", "no_such_pkg.data:Digits.build")
    assert parse_args(["--model", "mypkg:build"]).data == "digits"       # psrt's data by default
    # psrt's models on the user's data, and the transformer too: the fit is checked when built
    assert parse_args(["--model", "transformer", "--data", "mypkg:text"]).model == "transformer"


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
    (["--model", "resnet"], "--model 'resnet': choose one of mlp, cnn, transformer, moe, or name your own as module:callable"),
    (["--data", "mnist"], "--data 'mnist': choose one of digits, text, synthetic, or name your own"),
    (["--model", "my models:build"], "--model 'my models:build': expected module:callable"),
    (["--model", "mypkg.models:"], "--model 'mypkg.models:': expected module:callable"),
    (["--data", ":build"], "--data ':build': expected module:callable"),
    (["--model", "mypkg.models:build", "--width", "64"], "--width shapes psrt's own models"),
    (["--model", "mypkg.models:build", "--pp", "2"], "use --model transformer"),
    (["--compress", "int8"], "--compress: invalid choice"),
    (["--model", "mlp", "--data", "text"], "--model mlp cannot train on --data text"),
    (["--resume"], "--resume needs --checkpoint"),
    (["--recompute"], "--recompute recomputes transformer blocks; --model mlp has none"),
    (["--sequence-parallel", "--model", "transformer"], "--sequence-parallel splits the sequence over the tensor-parallel ranks"),
    (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint"),
    (["--model", "moe", "--algorithm", "torch"], "--algorithm torch with --model moe"),
    (["--model", "moe", "--capacity-factor", "0"], "--capacity-factor 0.0: must be a positive number"),
    (["--model", "moe", "--capacity-factor", "nan"], "--capacity-factor nan: must be a positive number"),
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


@pytest.mark.parametrize("argv,size,batch,says", [
    ("--dp ring", 4, 64, None),
    ("--dp ps --servers 1", 4, 66, "global batch 66: the default 64 rounded up to split over 3 workers x 1 micro-batch"),
    ("--dp ps,ring,ps-async", 8, 112, "over 7, 8 workers"),
    ("--dp ring --accum 3", 2, 66, "x 3 micro-batches (--accum)"),
    ("--dp ring --pp 2 --tp 2 --model transformer", 12, 66, "over 3 workers"),
    # moe on a grid: the batch splits over dp = ranks / (pp x tp), not over the ranks
    ("--model moe --pp 2 --tp 2 --ep 3 --experts 3", 12, 66, "over 3 workers"),
    ("--model moe --pp 2 --ep 2 --batch-size 6", 4, 6, None),
    ("--model moe --ep 4", 4, 64, None),
])
def test_the_default_batch_fits_every_strategy(argv, size, batch, says):
    cfg = parse_args(argv.split())
    note = plan_batch(cfg, size)
    assert cfg.batch_size == batch
    assert (note is None) if says is None else (says in note)


@pytest.mark.parametrize("argv,size,words", [
    ("--dp ring,ps-async --batch-size 64", 4, "--batch-size 64 does not split evenly over the 3 workers of --dp ps-async x 1 micro-batch (--accum): use a multiple of 12"),
    ("--dp ring --batch-size 4", 8, "the 8 workers of --dp ring"),
    ("--dp ring --pp 3 --model transformer", 8, "process grid pp=3 x tp=1 does not divide 8 ranks"),
    ("--dp ps-sharded --servers 4", 4, "leaves no worker among 4 ranks"),
    ("--model moe --pp 2 --ep 4", 4, "--ep 4 must divide the data-parallel degree 2: expert parallelism is "
     "carved out of data parallelism (here 4 ranks / (--pp 2 x --tp 1))"),
    ("--model moe --tp 2 --ep 2 --batch-size 6", 8, "--batch-size 6 does not split evenly over the 4 workers"),
    ("--model moe --ep 3 --experts 6", 4, "--ep 3 must divide the data-parallel degree 4: expert parallelism "
     "is carved out of data parallelism (here 4 ranks)"),
])
def test_a_batch_or_layout_that_cannot_work_is_refused_before_training(argv, size, words):
    with pytest.raises(PsrtError) as err:
        plan_batch(parse_args(argv.split()), size)
    assert words in str(err.value) and err.value.everywhere


def test_an_output_directory_that_is_missing_is_made_before_the_first_step(tmp_path):
    """`--trace out/trace.json` in a fresh checkout (no out/ yet) works, as `mkdir -p` would;
    a directory that cannot be made is one line naming it."""
    wanted = tmp_path / "out" / "runs" / "trace.json"
    check_paths(dataclasses.replace(TrainConfig(), trace=str(wanted), metrics=str(tmp_path / "m" / "m.jsonl")))
    assert wanted.parent.is_dir() and (tmp_path / "m").is_dir() and not wanted.exists()
    with pytest.raises(PsrtError, match=r"^--save /proc/psrt-none/x\.pt: cannot make directory /proc/psrt-none \("):
        check_paths(dataclasses.replace(TrainConfig(), save="/proc/psrt-none/x.pt"))
