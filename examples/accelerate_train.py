"""HF Accelerate on the psrt backend: a small regression trained by `Accelerator`.

    ./mpi_launch -np 2 python examples/accelerate_train.py           # psrt (rank, rendezvous from MPI)
    torchrun --nproc-per-node 2 examples/accelerate_train.py         # gloo, for comparison

Accelerate picks a CPU job's backend by name and keeps a default group that exists already, so
the one psrt line is the `init_process_group` before the `Accelerator` is made.
"""
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed

import psrt.c10d

dist.init_process_group("psrt" if psrt.c10d.launched_by_mpi() else "gloo")   # first: Accelerate keeps it
accelerator = Accelerator(cpu=True)
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
x = torch.randn(6 * 4 * accelerator.num_processes, 8, generator=g)
y = x.sum(dim=1, keepdim=True).sin()
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
accelerator.print(f"Accelerate on {dist.get_backend()}: {accelerator.num_processes} processes")
for step, (xb, yb) in enumerate(data):
    loss = torch.nn.functional.mse_loss(model(xb), yb)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    mean = accelerator.gather(loss.detach().reshape(1)).mean().item()   # every rank's loss
    accelerator.print(f"step {step}: loss {mean:.6f}")
# The prepared model (DDP) goes before the process group: a gloo group dropped last by DDP's
# reducer waits for its worker threads while holding the GIL, which a worker freeing a tensor
# also needs, and hangs now and then (pytorch/pytorch#56297).
model = optimizer = data = None
accelerator.free_memory()               # Accelerate's own references to them
dist.destroy_process_group()
