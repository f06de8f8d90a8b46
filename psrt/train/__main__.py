"""`python -m psrt.train`: see psrt/train/loop.py."""
import sys

from psrt.train.loop import main

sys.exit(main())
