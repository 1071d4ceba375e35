"""``horovodrun`` for the tests: Horovod's own launcher, with its build check done once per test session.

On every launch, ``horovodrun`` asks whether Horovod was built with Gloo (or MPI) by importing
``horovod.tensorflow`` -- all of TensorFlow -- in a fresh process: about 4 s of CPU on a 2-core
machine, before any rank starts. The suite starts over a hundred jobs. :func:`tests.helpers.ranks.rank_env`
runs Horovod's real check once per session, in a fresh interpreter, and passes its answers in
``HVDTRAIN_TEST_HOROVOD_BUILT``; this entry point hands them to the launcher and then runs it
unchanged (``horovod.runner.launch.run_commandline``, all that the ``horovodrun`` script runs).
Without the variable it is plain ``horovodrun``. The tests of ``launch/`` (``tests/test_launch.py``,
the elastic launch script) and of ``benchmarks/`` run the real ``horovodrun`` binary.

    python -m tests.helpers.horovodrun -np 2 -H localhost:2 --gloo python -m hvdtrain ...
"""
import os
import sys

ENV = "HVDTRAIN_TEST_HOROVOD_BUILT"  # "gloo=1,mpi=0": the session's answers to Horovod's build check


def main() -> None:
    from horovod.runner import launch

    answers = dict(item.split("=") for item in os.environ.get(ENV, "").split(",") if item)
    if answers:
        launch.gloo_built = lambda verbose=False: answers["gloo"] == "1"
        launch.mpi_built = lambda verbose=False: answers["mpi"] == "1"
    sys.argv[0] = "horovodrun"  # as Horovod's messages name it
    launch.run_commandline()


if __name__ == "__main__":  # the launcher starts processes with multiprocessing's spawn, which re-imports this module
    main()
