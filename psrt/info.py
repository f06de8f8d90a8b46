"""`python -m psrt.info`: where did my ranks land? (psrt/launch/info.py)."""
import sys

from psrt.launch.info import main

if __name__ == "__main__":
    sys.exit(main())
