"""How MPI is told to run on the emulated cluster's hosts (psrt/launch/cluster.py): its
daemons started through the launch agent instead of ssh, its traffic on TCP over the
emulated links only.  `cluster` below is a psrt.launch.cluster.Cluster."""
from __future__ import annotations

from psrt.errors import PsrtError
from psrt.launch.plan import ROOT

AGENT = ROOT / "scripts" / "netns_agent"
IFACE = "eth0"  # each host's link, as on a real machine


def mpi_flags(cluster, flavour: str) -> list[str]:
    """Launcher flags that start the daemons through the agent and keep MPI's traffic
    between hosts on the emulated links."""
    if flavour == "mpich":
        launch, transport = _hydra_settings()
        return [x for flag, _, value in launch for x in (flag, value)] + \
            [x for k, v in transport.items() for x in ("-genv", k, v)]
    return [x for k, v in _openmpi_params(cluster, flavour) for x in (_flag(k), _name(k), v)]


def mpi_env(cluster, flavour: str) -> dict:
    """The same settings as environment variables, for a plain `mpirun` typed by the user."""
    if flavour == "mpich":
        launch, transport = _hydra_settings()
        return {**{var: value for _, var, value in launch}, **transport}
    env = {f"{'PRTE' if k.startswith('prte:') else 'OMPI'}_MCA_{_name(k)}": v
           for k, v in _openmpi_params(cluster, flavour)}
    # Root is the norm inside an emulated cluster (making it needs root).
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PRTE_ALLOW_RUN_AS_ROOT="1", PRTE_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


def _flag(key: str) -> str:
    return "--prtemca" if key.startswith("prte:") else "--mca"


def _name(key: str) -> str:
    return key.split(":", 1)[-1]


def _openmpi_params(cluster, flavour: str) -> list[tuple[str, str]]:
    if not flavour.startswith("openmpi"):
        raise PsrtError(f"the emulated cluster drives Open MPI and MPICH, not {flavour}")
    # Open MPI 5 moved the launcher's settings to PRRTE (plm_ssh_*, --prtemca).
    rte = "prte:plm_ssh" if flavour == "openmpi5" else "plm_rsh"
    oob = "prte:oob_tcp_if_include" if flavour == "openmpi5" else "oob_tcp_if_include"
    return [
        (f"{rte}_agent", str(AGENT)),
        # Every daemon is started from mpirun's namespace, not by another daemon.
        (f"{rte}_no_tree_spawn", "1"),
        # ob1 is the messaging layer that uses the BTLs below; the UCX or OFI ones, picked
        # first where their hardware is found, would bypass them.
        ("pml", "ob1"),
        # Shared memory inside a host, as on a real one, and TCP between hosts: each host's
        # daemon is a node of its own to the library, so its shared-memory BTL never pairs
        # ranks of two hosts (tests/netns/test_cluster.py counts the bytes on the link).
        # Open MPI 5 renamed vader to sm.
        ("btl", "self,sm,tcp" if flavour == "openmpi5" else "self,vader,tcp"),
        ("btl_tcp_if_include", cluster.subnet),
        # The TCP BTL's default flags less `put`.  With put, the rest of a large message
        # (over btl_tcp_min_rdma_pipeline_size) is one fragment on the pair's one
        # connection (btl_tcp.c, mca_btl_tcp_put), and the endpoint sends its fragments one
        # at a time (btl_tcp_endpoint.c): in a two-way exchange, the go-ahead for the
        # peer's data waits behind this side's whole message, so the two directions often
        # ran one after the other.  Measured on 2 hosts of one rank at 250 Mbit/s, 25
        # back-to-back MPI_Allreduce of 12.2 MiB (Rabenseifner's two exchanges): 0.43 to
        # 0.64 s with put, every one 0.43 s without, the link's rate both ways at once, as
        # an accelerator fabric runs it.  Without put, ob1 sends the message as fragments
        # of btl_tcp_max_send_size (128 KiB) between which the go-ahead passes.
        ("btl_tcp_flags", "send,inplace,need-ack,need-csum,hetero-rdma"),
        (oob, cluster.subnet),
    ]


def _hydra_settings() -> tuple[list[tuple[str, str, str]], dict]:
    """MPICH's Hydra: ([(flag, environment variable, value)], transport variables)."""
    launch = [("-launcher", "HYDRA_LAUNCHER", "ssh"),
              ("-launcher-exec", "HYDRA_LAUNCHER_EXEC", str(AGENT)),
              ("-iface", "HYDRA_IFACE", IFACE)]
    # MPICH's UCX and libfabric layers carry shared-memory transports of their own, which
    # see one machine and reach across the namespaces: only TCP may carry MPI's traffic.
    transport = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFACE, "FI_PROVIDER": "tcp"}
    return launch, transport
