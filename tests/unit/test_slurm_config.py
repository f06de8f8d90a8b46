"""The slurm.conf psrt writes for an emulated cluster, and how its daemons are started
(psrt/launch/slurm.py): pure, no Slurm needed."""
from psrt.launch import cluster as C
from psrt.launch import slurm


def _cluster():
    return C.Cluster(("node0", "node1", "node2"), "198.18.3.0/24", slurm=True)


def test_config_names_every_node_at_its_address():
    text = slurm.config(_cluster())
    assert "SlurmctldHost=node0(198.18.3.1)" in text
    for i, h in enumerate(("node0", "node1", "node2")):
        assert f"NodeName={h} NodeAddr=198.18.3.{i + 1} CPUs=4 State=UNKNOWN" in text
    assert "PartitionName=emulated Nodes=ALL Default=YES" in text


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
