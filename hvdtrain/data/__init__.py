"""Training data: loading datasets (:mod:`~hvdtrain.data.datasets`) and sharding them exactly over
the ranks (:mod:`~hvdtrain.data.sharding`)."""
