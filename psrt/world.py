"""The MPI world: who this process is, where it runs, and how torch.distributed joins it.

`init()` works under mpirun (Open MPI, MPICH/Hydra), srun, horovodrun and as a single plain
process.  Node layout comes from MPI itself (`Split_type(COMM_TYPE_SHARED)`, refined by host
name), not from launcher variables, so it is right however the ranks were placed.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field

from psrt import env
from psrt.errors import PsrtError, launcher_rank


@dataclass(frozen=True)
class World:
    """One process's view of the job.  Build it once with `init()` and pass it explicitly.

    `comm` is a private Dup of the parent communicator, so psrt's messages never match
    the user's; `local_comm` holds the ranks on this host.
    """

    comm: object = field(repr=False)
    local_comm: object = field(repr=False)
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    hostname: str
    launcher: str
    # The watchdog `init()` started (psrt.watchdog), or None: it watches every Communicator
    # made on these ranks, and tells the others when this process leaves.
    watchdog: object = field(default=None, repr=False, compare=False)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def prefix(self) -> str:
        """`[rank N@host]`, the prefix for output where the rank matters."""
        return f"[rank {self.rank}@{self.hostname}]"

    def log(self, *args, root_only: bool = False, **kwargs) -> None:
        """Print with the rank prefix (only on rank 0 when `root_only`)."""
        if root_only and self.rank != 0:
            return
        print(self.prefix(), *args, flush=True, **kwargs)

    def free(self) -> None:
        """Release the private communicators (call before MPI finalises, if at all)."""
        for c in (self.local_comm, self.comm):
            if c is not None:
                c.Free()


def detect_launcher(env=os.environ) -> str:
    """Name the launcher from the variables it exports (first match wins).

    MPI's own variables come before Slurm's: mpirun inside an allocation starts its
    daemons with srun, so its ranks inherit SLURM_PROCID as well.  Hydra (MPICH, Intel MPI)
    is known by MPI_LOCALRANKID; PMI_RANK or PMIX_RANK alone under Slurm is srun --mpi=pmi2
    or --mpi=pmix.
    """
    if "HOROVOD_RANK" in env or "HOROVOD_HOSTNAME" in env:
        return "horovodrun"
    if "OMPI_COMM_WORLD_RANK" in env:
        return "openmpi"
    if "MPI_LOCALRANKID" in env:
        return "mpich"
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return "srun"
    if "PMI_RANK" in env:
        return "mpich"
    if "PMIX_RANK" in env:
        return "pmix"
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env):
        return "torchrun"
    return "single"



def _slurm_tasks_here(environ) -> int | None:
    """Tasks on this node from SLURM_TASKS_PER_NODE ("2(x3),1": two on each of the first three
    nodes, one on the fourth) and SLURM_NODEID, which srun sets whatever the distribution."""
    spec, node = environ.get("SLURM_TASKS_PER_NODE", ""), environ.get("SLURM_NODEID", "")
    if not spec or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def _env_local_size(environ=os.environ) -> int | None:
    """Ranks on this host as the launcher announced them (mpirun, horovodrun, srun, Hydra,
    torchrun), before MPI starts."""
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    here = _slurm_tasks_here(environ)
    if here is not None:
        return here
    for key in ("SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return None


def yield_before_mpi_starts(environ=os.environ) -> str | None:
    """Make ranks that wait in MPI give up the core when the host is crowded.

    A rank busy-polling for a message takes the core from the rank it waits for, and on an
    emulated cluster from the kernel's network work too (an Open MPI ping-pong across a veth
    took 4.8 ms one way busy-polling, 14 us yielding; docs/how-to/launching.md).  Open MPI reads
    mpi_yield_when_idle from this process's environment at MPI_Init, so it is set here, the
    same under mpirun, horovodrun and srun, by the rule the launchers follow
    (psrt.env.yield_when_idle):
    - PSRT_YIELD=0 or 1 decides, over any OMPI_MCA_mpi_yield_when_idle the process inherited
      (`mpirun --mca`, mpi_launch and the emulated cluster pass theirs that way) and over
      Open MPI's own choice to yield on a host mpirun knows is oversubscribed;
    - without it, an OMPI_MCA_mpi_yield_when_idle already set (by the user or the launcher) is
      kept;
    - without either, ranks yield when the launcher announced more ranks on this host than it
      has cores.
    Returns what to tell the user, or None.
    """
    local, cores = _env_local_size(environ), os.cpu_count() or 1
    setting = env.yield_when_idle(local is not None and local > cores, environ)
    if setting is None:
        return None
    environ["OMPI_MCA_mpi_yield_when_idle"] = setting
    if env.get("PSRT_YIELD", environ) is not None:
        return "ranks yield the core while they wait in MPI (PSRT_YIELD=1)" if setting == "1" else None
    return (f"{local} ranks on this host's {cores} cores: ranks yield the core while they wait "
            "in MPI (Open MPI's mpi_yield_when_idle; PSRT_YIELD=0 turns it off)")


def mpi_yields_when_idle() -> bool | None:
    """Whether this process's MPI yields the core while it waits: Open MPI's
    mpi_yield_when_idle as MPI_Init settled it, read back through the MPI tool interface
    (MPI 4.1 §15.3.6, control variables), not from the environment.  None where MPI has not
    started or the library has no such variable (MPICH yields by default)."""
    import ctypes
    import ctypes.util

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    try:
        with open("/proc/self/maps") as f:      # the libmpi mpi4py loaded, not another one
            paths = sorted(set(re.findall(r"/\S*/libmpi\.so[.\d]*", f.read())))
        lib = ctypes.CDLL(paths[0] if paths else ctypes.util.find_library("mpi"))
        provided, index, count = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
            return None
    except (OSError, AttributeError, TypeError):
        return None
    try:
        if lib.MPI_T_cvar_get_index(b"mpi_yield_when_idle", ctypes.byref(index)) != 0:
            return None
        handle = ctypes.c_void_p()
        if lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != 0:
            return None
        value = (ctypes.c_int * 16)()         # a bool variable reads as one MPI_INT
        ok = lib.MPI_T_cvar_read(handle, value) == 0
        lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
        return bool(value[0]) if ok else None
    finally:
        lib.MPI_T_finalize()


def host_key(hostname: str | None = None) -> str:
    """What tells this process's host from others: its processor name, refined by its entry
    in PSRT_HOSTS where that fakes a placement on one machine."""
    if hostname is None:
        from mpi4py import MPI
        hostname = MPI.Get_processor_name() or socket.gethostname()
    fake = env.fake_hosts()
    if fake is None:
        return hostname
    rank = launcher_rank()
    if rank is None or rank >= len(fake):
        raise PsrtError(f"PSRT_HOSTS={','.join(map(str, fake))}: names {len(fake)} ranks' hosts, "
                        f"but this is rank {rank}: give one host number per rank", everywhere=True)
    return f"{hostname}#{fake[rank]}"


def machine_key() -> str:
    """What tells the machine whose cores this process runs on: the kernel's boot id, which
    every network namespace of one machine shares (emulated hosts are namespaces of one
    machine, sharing its cores), with the host name where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def crowding(machines: list, cores: list) -> float:
    """Ranks per core on the most crowded machine, given each rank's machine key and core
    count (1.0 when every rank has a core of its own)."""
    per: dict = {}
    for m, c in zip(machines, cores):
        count, n = per.get(m, (0, c))
        per[m] = (count + 1, n)
    return max([1.0] + [count / max(n, 1) for count, n in per.values()])


def _env_world_size(env=os.environ) -> int | None:
    """World size the launcher announced, if any (used to catch a mismatched MPI)."""
    for key in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "HOROVOD_SIZE",
                "WORLD_SIZE"):
        if key in env:
            try:
                return int(env[key])
            except ValueError:
                return None
    return None


def _mismatch(launcher: str, announced: int, seen: int, env=os.environ) -> str:
    """Why the launcher's rank count and MPI's differ, and what to run instead."""
    gloo = env.get("HOROVOD_CONTROLLER") == "gloo" or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env
    if seen == 1 and (launcher == "torchrun" or gloo):
        # torchrun and horovodrun --gloo start plain processes: each is an MPI world of one.
        name = "horovodrun --gloo" if gloo else "torchrun"
        return (f"{name} started {announced} processes without MPI, so each is an MPI world "
                f"of 1: psrt joins ranks through MPI; start them with "
                f"`mpi_launch -np {announced} ...` or mpirun"
                + (" (or horovodrun --mpi)" if gloo else ""))
    # A launcher from one MPI and an mpi4py built against another start N singletons.
    return (f"the launcher ({launcher}) announced {announced} ranks but MPI sees {seen}: "
            "mpirun and mpi4py come from different MPI libraries (check `which mpirun` and "
            "`python -c 'import mpi4py; print(mpi4py.get_config())'`)")


def init(comm=None, export_env: bool = True) -> World:
    """Initialise MPI (if needed) and describe this process.

    Args:
        comm: parent communicator; defaults to MPI.COMM_WORLD.  psrt works on a Dup of it.
        export_env: set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and the
            rendezvous MASTER_ADDR/MASTER_PORT (rank 0 picks a free port) in os.environ.

    psrt.init (psrt.watchdog.init) adds the watchdog over these ranks.
    """
    if sys.excepthook is sys.__excepthook__:   # leave a hook the program installed alone
        from psrt import faults
        faults.install()   # an exception on one rank ends the job instead of hanging it
    env.check_all()        # (after the hook: a bad PSRT_* value in a user's script is one line)
    # Only a process whose MPI has not started yet can still be told to yield.
    started = "mpi4py.MPI" in sys.modules and sys.modules["mpi4py.MPI"].Is_initialized()
    notice = None if started else yield_before_mpi_starts()
    from mpi4py import MPI

    parent = MPI.COMM_WORLD if comm is None else comm
    launcher = detect_launcher()
    announced = _env_world_size()
    if comm is None and launcher != "single" and announced and announced != parent.size:
        # The processes cannot reach each other, and their launcher ends the job as soon as one
        # exits: the launcher's rank 0 says it for all, and the others leave a moment later so
        # as not to cut it off before it has spoken.
        if launcher_rank() not in (None, 0):
            time.sleep(2.0)
        raise PsrtError(_mismatch(launcher, announced, parent.size), everywhere=True)
    dup = parent.Dup()
    hostname = MPI.Get_processor_name() or socket.gethostname()
    # Shared-memory domain first, then split by host name as well: a namespace-emulated
    # host or a container may share a kernel with its neighbours but not its name.
    shared = dup.Split_type(MPI.COMM_TYPE_SHARED, key=dup.rank)
    local = shared.Split(color=zlib.crc32(host_key(hostname).encode()) & 0x7FFFFFFF, key=dup.rank)
    shared.Free()
    # Node rank: leaders (local rank 0) numbered in order of their global rank.
    is_leader = local.rank == 0
    leaders = dup.allgather(dup.rank if is_leader else -1)
    leader_ranks = sorted(r for r in leaders if r >= 0)
    node_rank = local.bcast(leader_ranks.index(dup.rank) if is_leader else None, root=0)
    world = World(comm=dup, local_comm=local, rank=dup.rank, size=dup.size,
                  local_rank=local.rank, local_size=local.size, node_rank=node_rank,
                  num_nodes=len(leader_ranks), hostname=hostname, launcher=launcher)
    if export_env:
        export_torch_env(world)
    if notice and world.rank == 0:
        print(f"psrt: {notice}", file=sys.stderr, flush=True)
    return world


def ulfm_refusal(environ=os.environ) -> str | None:
    """None when this process can recover from a lost rank inside the job, else why not.

    That takes ULFM (the MPI Forum's User-Level Failure Mitigation, MPI_Comm_revoke /
    MPI_Comm_shrink, a dead peer returned as MPI_ERR_PROC_FAILED instead of the job's end),
    which Open MPI 5 has when built with it (`ompi_info`: "FT MPI support: yes") and turns on
    for a job started with `mpirun --with-ft ulfm`; that option reaches the ranks as
    OMPI_MCA_mpi_ft_enable.  Open MPI 4.1 and this machine's MPICH have no working ULFM."""
    from mpi4py import MPI
    library = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    if not hasattr(MPI.Comm, "Shrink") or not re.match(r"Open MPI v([5-9]|\d\d)", library):
        return f"the MPI here ({library}) cannot shrink a communicator after a rank is lost (no ULFM)"
    import mpi4py
    if mpi4py.rc.errors == "fatal":      # MPI_ERRORS_ARE_FATAL: a dead peer ends the process
        return "mpi4py.rc.errors is 'fatal', so a lost rank cannot be returned as an error"
    if environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return ("the job was started without ULFM: start it with mpi_launch --in-job-recovery "
                "(mpirun --with-ft ulfm --mca btl tcp,self)")
    return None


# ULFM's error classes: a peer of the call died, or a survivor revoked the communicator.
FAILURE_CLASSES = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")


def lost_peer(err: BaseException | None) -> str | None:
    """The ULFM error class named in `err` or an exception it was raised from (a process of
    the call died, or a survivor revoked the communicator), else None."""
    from mpi4py import MPI
    classes = {getattr(MPI, name): name for name in FAILURE_CLASSES if hasattr(MPI, name)}
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, MPI.Exception) and err.Get_error_class() in classes:
            return "MPI_" + classes[err.Get_error_class()]
        err = err.__cause__ or err.__context__
    return None


def revoke(comm) -> None:
    """MPI_Comm_revoke (ULFM) `comm`, so that every rank's call on it returns; one already
    revoked or freed is left as it is."""
    try:
        comm.Revoke()
    except Exception:  # noqa: BLE001 - revoked before, freed, or a null communicator
        pass


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def _host_address(world: World) -> str:
    """An address of rank 0 that the other ranks can reach."""
    if env.master_addr():
        return env.master_addr()
    if world.num_nodes == 1 or env.fake_hosts() is not None:   # faked hosts share one machine
        return "127.0.0.1"
    try:
        addr = socket.gethostbyname(world.hostname)
    except OSError:
        addr = ""
    if not addr or addr.startswith("127."):
        raise PsrtError(
            f"rank 0's host name {world.hostname!r} resolves to {addr or 'nothing'}, which other "
            "hosts cannot reach: set PSRT_MASTER_ADDR to rank 0's address")
    return addr


def export_torch_env(world: World) -> dict:
    """Export torchrun's variables so `torch.distributed.init_process_group("env://")` joins.

    MASTER_ADDR/MASTER_PORT already in the environment (set by the user or torchrun) win;
    otherwise rank 0 picks a free port on its host and broadcasts it: no fixed port.
    """
    master = None
    if world.rank == 0:
        addr = os.environ.get("MASTER_ADDR") or _host_address(world)
        port = os.environ.get("MASTER_PORT") or str(_free_port("" if world.num_nodes > 1 else addr))
        master = (addr, port)
    addr, port = world.comm.bcast(master, root=0)
    values = {
        "RANK": str(world.rank), "WORLD_SIZE": str(world.size),
        "LOCAL_RANK": str(world.local_rank), "LOCAL_WORLD_SIZE": str(world.local_size),
        "NODE_RANK": str(world.node_rank), "GROUP_RANK": str(world.node_rank),
        "MASTER_ADDR": addr, "MASTER_PORT": port,
    }
    os.environ.update(values)
    return values


def init_torch_distributed(world: World, backend: str | None = None, timeout_s: float | None = None):
    """Join torch.distributed using the world's rendezvous (gloo on CPU, nccl where each rank
    has a GPU of its own).

    Returns the default process group.  Safe to call twice.
    """
    if "MASTER_PORT" not in os.environ:
        export_torch_env(world)
    return join_torch_distributed(world.rank, world.size, backend, timeout_s)


def torch_backend_for(asked: str | None, cuda: bool, local_size: int, gpus: int, nccl: bool) -> str:
    """The torch.distributed backend to join: `asked`, or nccl where CUDA is there and each of
    the `local_size` ranks of this host has a GPU of its own (and torch has NCCL), else gloo,
    which also reduces CUDA tensors (through host memory) for ranks that share a GPU.  NCCL
    refuses two ranks on one GPU at its first call; asked for it there, this says so in one
    line instead."""
    if asked is None:
        return "nccl" if cuda and nccl and local_size <= gpus else "gloo"
    if asked == "nccl" and cuda and local_size > gpus:
        raise PsrtError(f"backend nccl: {local_size} ranks on this host share {gpus} GPU(s), and NCCL "
                        "needs one GPU per rank: start one rank per GPU, or use gloo or psrt",
                        everywhere=True)
    return asked


def join_torch_distributed(rank: int, size: int, backend: str | None = None,
                           timeout_s: float | None = None):
    """The one way psrt joins torch.distributed: env:// with the MASTER_ADDR/MASTER_PORT that
    psrt.init() exported (or torchrun set).  Returns the default group; joins only once.

    Args:
        backend: 'gloo', 'nccl' or None (nccl where each rank of a host has a GPU of its
            own, else gloo: `torch_backend_for`).
        timeout_s: how long a torch.distributed call may wait (default: PSRT_TIMEOUT).
    """
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.group.WORLD
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise PsrtError("joining torch.distributed needs MASTER_ADDR/MASTER_PORT: call psrt.init() "
                        "(which exports them) or psrt.init_torch_distributed(world) first")
    cuda = torch.cuda.is_available()
    backend = torch_backend_for(backend, cuda, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                torch.cuda.device_count() if cuda else 0, dist.is_nccl_available())
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    timeout_s = env.timeout_s() if timeout_s is None else timeout_s
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD
