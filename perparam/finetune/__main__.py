"""``python -m perparam.finetune [flags]``: the same as ``perparam finetune [flags]``.

Under ``torchrun`` (which sets ``RANK`` and ``WORLD_SIZE``) every process acts as a worker; otherwise this
is the launcher, which starts ``--nproc`` workers itself.
"""

import sys

from perparam.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["finetune", *sys.argv[1:]]))
