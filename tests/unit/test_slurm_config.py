"""The slurm.conf psrt writes for an emulated cluster, and how its daemons are started
(psrt/launch/slurm.py): pure, no Slurm needed."""
import json
import os

import pytest

from psrt.errors import PsrtError
from psrt.launch.info import slurm_line
from psrt.launch import cluster as C
from psrt.launch import cluster_cli as CLI
from psrt.launch import slurm

ROOT = slurm.ROOT
CORES = os.cpu_count()


def _cluster(slots=()):
    return C.Cluster(("node0", "node1", "node2"), "198.18.3.0/24", slurm=True, slots=slots)


def test_config_names_every_node_at_its_address_with_its_slots_as_cpus():
    text = slurm.config(_cluster((4, 2, None)))
    assert "SlurmctldHost=node0(198.18.3.1)" in text
    for i, (h, cpus) in enumerate(zip(("node0", "node1", "node2"), (4, 2, CORES))):
        assert f"NodeName={h} NodeAddr=198.18.3.{i + 1} CPUs={cpus} State=UNKNOWN" in text
    assert "PartitionName=emulated Nodes=ALL Default=YES" in text
    assert f"NodeName=node1 NodeAddr=198.18.3.2 CPUs={CORES} " in slurm.config(_cluster())


def test_up_takes_slots_from_the_hostfile_and_says_how_to_submit(tmp_path):
    args = CLI._parser().parse_args(["up", "--slurm", "--hostfile", str(ROOT / "hostfiles" / "two_nodes")])
    two = CLI._cluster_from(args)
    assert two.slots == (4, 4) and slurm.srun_hint(two) == "srun -N 2 -n 8 --mpi=pmix"
    assert two.describe()[0].endswith("Slurm (slurmctld on node0, a slurmd per host, 4 CPUs each)")
    (tmp_path / "h").write_text("a slots=3\nb slots=1\nc slots=2\n")
    three = CLI._cluster_from(CLI._parser().parse_args(["up", "--slurm", "--hostfile", str(tmp_path / "h")]))
    assert slurm.srun_hint(three) == "srun -N 3 -n 6 --mpi=pmix"
    assert three.describe()[0].endswith("a slurmd per host, a 3 CPUs, b 1 CPUs, c 2 CPUs)")
    # the record `down` and `exec` read back keeps them
    again = C.Cluster(**json.loads(json.dumps(C.asdict(three))))
    assert again == three and slurm.config(again) == slurm.config(three)
    with pytest.raises(PsrtError, match="slots .* must give a positive count"):
        C.Cluster(("a", "b"), slots=(1,))


def _record(rank, host, local, node, procid=None, nodename=None, localid=None, nodeid=None):
    return {"rank": rank, "hostname": host, "local_rank": local, "node_rank": node, "launcher": "srun",
            "slurm": {"job_id": "7", "nodelist": "n[0-1]", "procid": str(rank if procid is None else procid),
                      "nodename": nodename or host, "localid": str(local if localid is None else localid),
                      "nodeid": str(node if nodeid is None else nodeid)}}


def test_slurm_line_says_whether_placement_matches_slurms():
    same = [_record(0, "n0", 0, 0), _record(1, "n0", 1, 0), _record(2, "n1", 0, 1)]
    assert slurm_line(same) == \
        "Slurm job 7 on n[0-1]: placement matches Slurm's (rank, host, local rank, node rank)"
    moved = same[:2] + [_record(2, "n1", 0, 1, nodename="n0", localid=2, nodeid=0)]
    assert slurm_line(moved) == ("Slurm job 7 on n[0-1]: placement differs from Slurm's: rank 2 (n1, "
                                 "local 0, node 1) is Slurm's task 2 (n0, local 2, node 0)")
    swapped = [_record(r, "n0", r, 0, procid=9 - r) for r in range(6)]
    assert slurm_line(swapped).count("is Slurm's task") == 4        # at most four named
    assert slurm_line([{k: v for k, v in r.items() if k != "slurm"} for r in same]) is None
    # mpirun inside an allocation: its ranks inherit the SLURM_* of mpirun's daemons
    by_mpirun = [dict(r, launcher="openmpi") for r in moved]
    assert slurm_line(by_mpirun) == "Slurm job 7 on n[0-1]: ranks started by openmpi inside the allocation, not by srun"


def test_config_needs_no_cgroups_and_keeps_files_per_node():
    text = slurm.config(_cluster())
    for line in ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SlurmdParameters=config_overrides",
                 "KillOnBadExit=1", "MpiDefault=pmix", "SlurmdSpoolDir=/run/psrt-slurm/node0/%n/spool",
                 "SlurmdPidFile=/run/psrt-slurm/node0/%n/slurmd.pid",
                 "AuthInfo=socket=/run/psrt-slurm/node0/munge/munge.socket"):
        assert line in text.splitlines(), line


def test_daemons_enter_only_the_network_namespace():
    argv = slurm.on_host(_cluster(), "node1", "slurmd -N node1")
    assert argv[:2] == ["nsenter", "--net=/run/netns/node1"]     # not `ip netns exec`: no new sysfs
    assert "--uts" in argv and "--mount" in argv
    script = argv[-1]
    assert "hostname node1" in script and "mount --bind /etc/netns/node1/hosts /etc/hosts" in script
    assert "mount --rbind /run/psrt-slurm/node0/node1/tmp /tmp" in script and script.endswith("exec slurmd -N node1")


def test_a_checkout_under_tmp_stays_visible_to_the_jobs(tmp_path):
    script = slurm.on_host(_cluster(), "node1", "slurmd", keep=tmp_path)[-1]
    mirror = f"/run/psrt-slurm/node0/node1/tmp/{tmp_path.relative_to('/tmp')}"
    assert f"mount --bind {tmp_path} {mirror}" in script
    assert script.index(mirror) < script.index("mount --rbind")   # before /tmp is covered
    assert "mkdir" not in slurm.on_host(_cluster(), "node1", "slurmd", keep=slurm.Path("/work/x"))[-1]


def test_cluster_describes_and_records_slurm():
    c = _cluster()
    assert "Slurm (slurmctld on node0" in c.describe()[0]
    assert C.Cluster(("a", "b")).slurm is False
    env = C.job_env(c, "openmpi4", {})
    assert env["SLURM_CONF"] == "/run/psrt-slurm/node0/slurm.conf"
    assert "SLURM_CONF" not in C.job_env(C.Cluster(("a", "b")), "openmpi4", {})


def test_daemons_and_jobs_use_pmix_hash_store_unless_the_user_chose():
    c = _cluster()
    got = slurm.env(c, {"PATH": "/bin"})
    assert got["PMIX_MCA_gds"] == "hash" and got["SLURM_CONF"] == str(slurm.conf_path(c))
    assert slurm.env(c, {"PMIX_MCA_gds": "ds21"})["PMIX_MCA_gds"] == "ds21"
    assert C.job_env(c, "openmpi4", {"PATH": "/bin"})["PMIX_MCA_gds"] == "hash"


def test_cuda_line_says_how_cuda_tensors_meet_mpi():
    """psrt.info's line on CUDA tensors: none without a GPU, else direct or staged, and a
    warning where ranks disagree (two MPIs in one job)."""
    from psrt.launch.info import cuda_line
    rec = lambda rank, gpus, direct, how: {"rank": rank, "gpus": gpus, "cuda_direct": direct, "cuda_support": how}
    assert cuda_line([rec(0, 0, False, "q = 0"), rec(1, 0, False, "q = 0")]) is None
    assert cuda_line([rec(r, 1, True, "MPIX_Query_cuda_support() = 1") for r in (0, 1)]) == \
        "CUDA tensors go straight to MPI: the library is CUDA-aware (MPIX_Query_cuda_support() = 1)"
    assert cuda_line([rec(0, 1, False, "MPIX_Query_cuda_support() = 0")]).startswith(
        "CUDA tensors are staged through pinned host memory: the MPI is not CUDA-aware")
    mixed = cuda_line([rec(0, 1, True, "PSRT_CUDA_AWARE=1"), rec(1, 1, False, "MPIX_Query_cuda_support() = 0")])
    assert "on ranks 0 only" in mixed and "disagree" in mixed
