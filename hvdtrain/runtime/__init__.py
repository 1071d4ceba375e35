"""How each process takes part in the job: Horovod start-up, the ranks' agreement, device and CPU
placement, the stall watchdog and stop signals.

* :mod:`hvdtrain.runtime.dist`: :class:`~hvdtrain.runtime.dist.DistContext`, the only place that
  asks Horovod who and how many we are, and the collectives outside the training step.
* :mod:`hvdtrain.runtime.placement`: CPU topology and each rank's share of the cores.
* :mod:`hvdtrain.runtime.priority`: helper threads' nice values, behind the training step's.
* :mod:`hvdtrain.runtime.watchdog`: a stalled or lost rank ends the job instead of hanging it.
* :mod:`hvdtrain.runtime.signals`: Ctrl-C and SIGTERM stop a run cleanly.
"""
