"""Cluster presets for predicting scaling past this machine: two levels of links (inside a
node, between nodes) as the alpha-beta model takes them, each figure cited.

A preset is accelerators per node, and per level a latency alpha and a bandwidth.  Between
nodes the bandwidth is the node's, all its NICs together: psrt's model charges every byte
leaving a node to that node's link (per-host NIC sharing, psrt.collectives.cost.link_load).
Bandwidths are the links' nominal rates; a real collective reaches 70-90% of them (NCCL's
bus bandwidth on DGX A100 is about 230 GB/s of NVLink's 300 GB/s per direction: NVIDIA's
nccl-tests PERFORMANCE.md), so predictions from these presets are lower bounds on time.

Your own: a JSON or TOML file with the keys of PRESETS' entries, e.g.

    name = "my-cluster"
    per_node = 4
    intra_gbit_s = 256        # per accelerator, one direction
    intra_alpha_us = 5
    inter_gbit_s = 100        # per node, all NICs together
    inter_alpha_us = 10
    source = "our vendor's sheet"
"""
from __future__ import annotations

import json
import math
import os

from psrt.collectives import cost
from psrt.errors import PsrtError

PRESETS = {
    "emulated": {
        "per_node": 4, "intra_gbit_s": 32.0, "intra_alpha_us": 2.0, "inter_gbit_s": 1.0, "inter_alpha_us": 50.0,
        "source": "psrt's emulated cluster: netem-shaped 1 Gbit/s veth links (psrt/launch/cluster.py); inside a "
                  "host, shared memory at about 4 GB/s and alpha 2 us, the figures psrt.collectives.cost.DEFAULT_LINKS "
                  "assumes (docs/explanation/benchmarks.md measures them)"},
    "dgx-a100": {
        "per_node": 8, "intra_gbit_s": 2400.0, "intra_alpha_us": 3.0, "inter_gbit_s": 1600.0, "inter_alpha_us": 5.0,
        "source": "NVIDIA DGX A100 datasheet (2020): 8 A100 GPUs on NVSwitch, 600 GB/s NVLink per GPU (300 GB/s "
                  "each way = 2400 Gbit/s), 8 ConnectX-6 HDR InfiniBand NICs of 200 Gbit/s for the cluster network "
                  "(1600 Gbit/s per node); latencies of a few microseconds (InfiniBand HDR, NVLink)"},
    "pcie-25g": {
        "per_node": 4, "intra_gbit_s": 126.0, "intra_alpha_us": 10.0, "inter_gbit_s": 25.0, "inter_alpha_us": 30.0,
        "source": "4 accelerators per node on PCIe 3.0 x16 (PCI-SIG: 15.75 GB/s each way, 126 Gbit/s) and one "
                  "25 Gbit/s Ethernet NIC (IEEE 802.3by) carrying TCP, whose one-way latency is tens of microseconds"},
}
KEYS = ("per_node", "intra_gbit_s", "intra_alpha_us", "inter_gbit_s", "inter_alpha_us")


def load(name_or_path: str) -> dict:
    """A preset by name (PRESETS) or from a .json/.toml file; bad input is one line."""
    if name_or_path in PRESETS:
        return {"name": name_or_path, **PRESETS[name_or_path]}
    if not os.path.exists(name_or_path):
        raise PsrtError(f"--preset {name_or_path!r}: choose one of {', '.join(PRESETS)}, or give a .json or "
                        ".toml file", everywhere=True)
    try:
        with open(name_or_path, "rb") as f:
            if name_or_path.endswith(".toml"):
                import tomllib
                data = tomllib.load(f)
            else:
                data = json.load(f)
    except Exception as err:   # noqa: BLE001 - a parse error of either format, in one line
        raise PsrtError(f"--preset {name_or_path}: cannot read it ({type(err).__name__}: {err})",
                        everywhere=True) from None
    if not isinstance(data, dict):
        raise PsrtError(f"--preset {name_or_path}: expected a table of {', '.join(KEYS)}", everywhere=True)
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise PsrtError(f"--preset {name_or_path}: missing {', '.join(missing)}", everywhere=True)
    for k in KEYS:
        v = data[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
            raise PsrtError(f"--preset {name_or_path}: {k} {v!r} must be a positive number", everywhere=True)
    if int(data["per_node"]) != data["per_node"]:
        raise PsrtError(f"--preset {name_or_path}: per_node {data['per_node']} must be whole", everywhere=True)
    return {"name": str(data.get("name", os.path.basename(name_or_path))), "source": str(data.get("source", "")),
            **{k: data[k] for k in KEYS}, "per_node": int(data["per_node"])}


def links(preset: dict) -> cost.Links:
    """The preset as the two-level model's Links (bytes per second from Gbit/s)."""
    intra = cost.Fit(preset["intra_alpha_us"] * 1e-6, 8 / (preset["intra_gbit_s"] * 1e9), 1.0)
    inter = cost.Fit(preset["inter_alpha_us"] * 1e-6, 8 / (preset["inter_gbit_s"] * 1e9), 1.0)
    return cost.Links(intra, inter)
