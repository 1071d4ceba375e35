"""Training data: opening the configured dataset (:mod:`~hvdtrain.data.loading`) -- in memory
(:mod:`~hvdtrain.data.in_memory`) or streamed by tf.data (:mod:`~hvdtrain.data.stream`: image
folders, TFRecord shards, a user's function) -- and sharding it exactly over the ranks
(:mod:`~hvdtrain.data.sharding`)."""
