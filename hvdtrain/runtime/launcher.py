"""What the launcher (horovodrun, mpirun, srun...) tells a process through its environment, read
before Horovod starts."""
from __future__ import annotations

import os

# The global rank, as the common launchers name it (Horovod's, OpenMPI's, PMIx, PMI, Slurm).
RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def launcher_rank() -> int:
    """The global rank the launcher gave this process, read from the environment.

    Usable before ``hvd.init()`` (e.g. for argument errors). Returns 0 when no launcher variable is
    set, i.e. for a plain ``python -m hvdtrain``.
    """
    for name in RANK_ENV_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0
