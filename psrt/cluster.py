"""`python -m psrt.cluster`: the emulated cluster's command line (psrt/launch/cluster_cli.py)."""
import sys

from psrt.launch.cluster_cli import main

if __name__ == "__main__":
    sys.exit(main())
