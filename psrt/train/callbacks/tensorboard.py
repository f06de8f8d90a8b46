"""--tensorboard DIR: the run as TensorBoard reads it, one run directory per strategy
(DIR/<dp>): per step the loss, the throughput, compute and communication time, the bytes sent
(each axis of a grid apart), the fp16 loss scale; the hyper-parameters once, in the HParams
dashboard.  Needs the `tensorboard` package (pip install 'psrt[tensorboard]')."""
from __future__ import annotations

import math
import os

from psrt.dp.driver import AXIS_BYTES
from psrt.errors import PsrtError
from psrt.train.events import Callback

METRICS = ("loss", "throughput/samples_per_s", "time/comm_s")


def summary_writer():
    """torch's SummaryWriter, or a one-line error saying what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams
    except ImportError:
        raise PsrtError("--tensorboard needs the tensorboard package: pip install tensorboard "
                        "(or pip install 'psrt[tensorboard]')", everywhere=True) from None
    return SummaryWriter, hparams


class TensorBoard(Callback):
    """Args:
        logdir: the directory of TensorBoard's runs; each strategy writes DIR/<dp>.
    """

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.make, self.hparams = summary_writer()
        self.writer = None
        self.last = 0.0           # run.time_s() at the end of the previous step (0: the loop's start)

    def on_run_start(self, run) -> None:
        if not run.is_lead or self.writer is not None:
            return
        self.writer = self.make(log_dir=os.path.join(self.logdir, run.dp))
        exp, ssi, sei = self.hparams({k: plain(v) for k, v in run.hparams.items()}, dict.fromkeys(METRICS, 0.0))
        for summary in (exp, ssi, sei):
            self.writer.file_writer.add_summary(summary)

    def on_step_end(self, run, stats) -> None:
        if self.writer is None or stats is None:
            return
        now, w, step = run.time_s(), self.writer, run.step
        if math.isfinite(stats.loss):
            w.add_scalar("loss", stats.loss, step)
        batch = run.hparams.get("batch_size")
        if batch:
            w.add_scalar("throughput/samples_per_s", batch / max(now - self.last, 1e-9), step)
        self.last = now
        w.add_scalar("time/compute_s", stats.compute_s, step)
        w.add_scalar("time/comm_s", stats.comm_s, step)
        w.add_scalar("bytes/sent", stats.bytes_sent, step)
        for key in AXIS_BYTES:
            if key in stats.extra:
                w.add_scalar(f"bytes/{key}", stats.extra[key], step)
        if run.scaler is not None:
            w.add_scalar("loss_scale", run.scaler.scale, step)

    def on_run_end(self, run, everyone, row) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def plain(value):
    """An hyper-parameter as the HParams plugin takes it: a number, a string or a bool."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)
