"""`python -m psrt.cluster`: the emulated cluster's command line (psrt/launch/cluster.py)."""
import sys

from psrt.launch.cluster import main

if __name__ == "__main__":
    sys.exit(main())
