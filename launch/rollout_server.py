"""`mgrpo-serve` from a checkout, without installing: the code is mgrpo/cli/serve.py (`--help` lists every flag).
torchrun and the Slurm scripts take this file."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mgrpo.cli.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
