"""`mgrpo-train` from a checkout, without installing: the code is mgrpo/cli/train.py (`--help` lists every flag).
torchrun and the Slurm scripts take this file. Restarts: `torchrun --max-restarts N ... --resume auto` resumes from the
newest checkpoint after a failed attempt (a fresh run if none was saved; docs/cluster.md, "Hangs and restarts")."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mgrpo.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
