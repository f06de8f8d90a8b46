"""A small model trained by HF Accelerate, transformers' Trainer or Lightning's Trainer on the
psrt or gloo backend.

usage: mpirun -np N python frameworks.py {accelerate|trainer|lightning} {psrt|gloo} OUT.json

Both frameworks pick a CPU job's backend by name (Accelerate's PartialState: "mpi" when torch
has it, else "gloo") and use a default group that exists already: so the default group is made
first, on the backend asked for, and the framework runs on it.  Rank 0 writes the per-step
losses, the backend the default group really has and how many collectives psrt's group ran.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import psrt.c10d

framework, backend, out = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ.setdefault("OMP_NUM_THREADS", "1")
dist.init_process_group(backend=backend)          # before the framework: it keeps this group
rank, world = dist.get_rank(), dist.get_world_size()
STEPS, BATCH, SEED = 6, 4, 0


def accelerate_losses() -> list[float]:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    accelerator = Accelerator(cpu=True)
    set_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(STEPS * BATCH * world, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses = []
    for xb, yb in data:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        # every rank's loss, gathered by Accelerate (its gather on the default group)
        losses.append(accelerator.gather(loss.detach().reshape(1)).mean().item())
    return losses


def trainer_losses() -> list[float]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
    set_seed(SEED)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 64, (STEPS * BATCH * world, 16), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(output_dir=os.environ.get("TMPDIR", "/tmp") + f"/psrt-trainer-{backend}",
                             per_device_train_batch_size=BATCH, max_steps=STEPS, logging_steps=1,
                             learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no",
                             dataloader_num_workers=0, seed=SEED, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def lightning_losses() -> list[float]:
    import lightning as L
    L.seed_everything(SEED, verbose=False)
    losses = []

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch, _index):
            xb, yb = batch
            loss = torch.nn.functional.mse_loss(self.net(xb), yb)
            # every rank's loss, gathered by Lightning (its all_gather on the default group)
            losses.append(self.all_gather(loss.detach()).mean().item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(STEPS * BATCH * world, 8, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    # Under mpirun Lightning finds the job through mpi4py (MPIEnvironment) and, finding the
    # default group made already, trains DDP on it
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), data)
    return losses


losses = {"accelerate": accelerate_losses, "trainer": trainer_losses, "lightning": lightning_losses}[framework]()
calls = dist.group.WORLD.group.calls if backend == "psrt" else 0
if rank == 0:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"losses": losses, "backend": dist.get_backend(), "psrt_calls": calls}, f)
dist.barrier()
dist.destroy_process_group()
# Leave without Python's finalization: a gloo worker thread that wakes while the interpreter
# shuts down tries to take the GIL and aborts the process (signal 6), now and then.  MPI is
# finalized first, so mpirun sees a clean exit.
from mpi4py import MPI  # noqa: E402
if MPI.Is_initialized() and not MPI.Is_finalized():
    MPI.Finalize()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
