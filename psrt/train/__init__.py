"""Training: `python -m psrt.train` (see __main__.py), its config, loop, data, models,
checkpoints and report.  Submodules are imported on use, so `--help` needs no torch."""
