"""Checkpoints: one file, written atomically by rank 0, holding every rank's state.

Each rank contributes its strategy's `state_dict()` (model, optimizer or its shard), its
RNG state and role; rank 0 gathers them and writes one file, so no shared file system is
needed and a checkpoint is never half one step and half another.  The write is atomic: a
temporary file in the same directory, fsync, `os.replace` (atomic on POSIX, rename(2)),
then fsync of the directory so the rename itself survives a crash.  Loading uses
`torch.load(weights_only=True)`, which unpickles tensors and plain containers only, never
arbitrary objects (a checkpoint is data, not code).

The sampler position is the global step: epoch and batch follow from it (see
data.ShardedSampler.position), and are stored as well for the reader's benefit.
"""
from __future__ import annotations

import contextlib
import glob
import os
import tempfile

import torch

from psrt import faults
from psrt.errors import PsrtError, StorageError

FORMAT = "psrt-checkpoint-1"
# Settings a checkpoint only makes sense with: resuming with another value is refused.
MUST_MATCH = ("model", "data", "width", "layers", "seq_len", "batch_size", "accum", "optimizer", "pp", "tp",
              "ep", "experts")


def atomic_save(obj, path: str, midway=None) -> None:
    """torch.save(obj) to `path` so that `path` holds either the old or the new file, whole.
    `midway()`, if given, runs between the write of the temporary file and its rename (where
    psrt.faults strikes a write half-way)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if midway is not None:
            midway()
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # Temp files of earlier writes that were killed half-way (SIGKILL skips the clean-up
    # above).  One process writes a given path, so no other write can be in flight here.
    for stale in glob.glob(os.path.join(directory, glob.escape("." + os.path.basename(path)) + ".*.tmp")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _agree(ctl, error: str | None, root: int = 0, kind=PsrtError) -> None:
    """Raise the root's error, a `kind`, on every rank (a collective: every rank calls it)."""
    error = ctl.bcast(error, root=root)
    if error:
        raise kind(error, everywhere=True)


def save(path: str, ctl, strategy, step: int, steps_per_epoch: int, config: dict) -> None:
    """Collective over `ctl` (an mpi4py communicator): every rank must call it."""
    mine = {"strategy": strategy.state_dict(), "rng": torch.get_rng_state(),
            "worker_rank": strategy.worker_rank}
    states = ctl.gather(mine, root=0)
    error = None
    if ctl.rank != 0:               # while rank 0 writes
        faults.strike_if_asked("checkpoint", step)
    if ctl.rank == 0:
        epoch, batch = divmod(step, steps_per_epoch)
        payload = {"format": FORMAT, "step": step, "epoch": epoch, "batch_in_epoch": batch,
                   "world_size": ctl.size, "config": {k: config[k] for k in MUST_MATCH + ("dp",)},
                   "ranks": states}
        try:
            atomic_save(payload, path, midway=lambda: faults.strike_if_asked("checkpoint", step))
        except OSError as err:
            error = (f"--checkpoint {path}: cannot write it ({err.strerror or err}); "
                     "the previous checkpoint there is kept")
    _agree(ctl, error, kind=StorageError)


def load(path: str, ctl, strategy, config: dict) -> int:
    """Restore this rank from `path`; returns the step to continue from.  Collective."""
    payload, error = None, None
    if ctl.rank == 0:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            error = _check(payload, path, ctl.size, config, getattr(strategy, "reshardable", False))
        except FileNotFoundError:
            error = f"--resume: no checkpoint at {path} (--checkpoint)"
        except Exception as err:  # noqa: BLE001 - a corrupt file must be one clear line
            error = f"--resume: {path} is not a readable psrt checkpoint ({type(err).__name__}: {err})"
    _agree(ctl, error)
    step = ctl.bcast(payload["step"] if ctl.rank == 0 else None, root=0)
    if ctl.bcast(payload["world_size"] if ctl.rank == 0 else None, root=0) != ctl.size:
        # A sharded state on another number of ranks: every rank reads every part and takes
        # its own under this run's ownership map (reshard on load).
        states = ctl.bcast(payload["ranks"] if ctl.rank == 0 else None, root=0)
        strategy.load_resharded([s["strategy"] for s in states])
        torch.set_rng_state(states[min(ctl.rank, len(states) - 1)]["rng"])
        return step
    mine = ctl.scatter(payload["ranks"] if ctl.rank == 0 else None, root=0)
    if mine["worker_rank"] != strategy.worker_rank:
        raise PsrtError(f"--resume: rank {ctl.rank} was worker {mine['worker_rank']} in the checkpoint "
                        f"but is {strategy.worker_rank} now (same --dp and --servers needed)")
    strategy.load_state_dict(mine["strategy"])
    torch.set_rng_state(mine["rng"])
    return step


def _check(payload, path: str, size: int, config: dict, reshardable: bool = False) -> str | None:
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return f"--resume: {path} is not a psrt checkpoint"
    if payload["world_size"] != size and not reshardable:
        return (f"--resume: {path} was written by {payload['world_size']} ranks, this job has "
                f"{size}: resume with mpirun -np {payload['world_size']}")
    saved = payload["config"]
    for key in MUST_MATCH + ("dp",):
        if saved.get(key) != config.get(key):
            flag = "--" + key.replace("_", "-")
            return (f"--resume: {path} was written with {flag} {saved.get(key)}, this run has "
                    f"{flag} {config.get(key)}")
    return None
