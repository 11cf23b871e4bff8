"""`mgrpo-train` from a checkout, without installing: the code is mgrpo/cli/train.py (`--help` lists every flag).
torchrun and the Slurm scripts take this file."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mgrpo.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
