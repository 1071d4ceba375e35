"""Models: the built-in zoo and user model functions (:mod:`~hvdtrain.model.zoo`), synchronized
BatchNorm (:mod:`~hvdtrain.model.sync_bn`, its CPU kernels in :mod:`~hvdtrain.model.sync_bn_kernels`)
and which layers keep per-rank statistics (:mod:`~hvdtrain.model.moving_statistics`)."""
