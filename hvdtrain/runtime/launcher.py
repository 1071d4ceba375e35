"""What the launcher (horovodrun, mpirun, srun...) tells a process through its environment, read
before Horovod starts."""
from __future__ import annotations

import os
from typing import Optional

# The global rank and the world size, as the common launchers name them (Horovod's, OpenMPI's,
# PMIx, PMI, Slurm).
RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
SIZE_ENV_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS")


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


def launcher_world_size() -> Optional[int]:
    """The world size the launcher gave the job, read from the environment before ``hvd.init()``;
    1 for a process no launcher started, None where a launcher does not say."""
    if not any(os.environ.get(name, "").isdigit() for name in RANK_ENV_VARS):
        return 1
    for name in SIZE_ENV_VARS:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None
