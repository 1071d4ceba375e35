"""Horovod's own TF2 API on Keras 3 objects, patched (scripts/horovod-patches/, 0006 and 0008): every
behaviour Horovod's test/parallel/test_tensorflow2_keras.py (0.28.1) checks, in its Keras 3 meaning,
and the pieces of a GradientTape loop (broadcast_variables, DistributedGradientTape with a local
source, PartialDistributedOptimizer, the Keras callbacks, elastic KerasState), at 2 real ranks
(tests/workers/horovod_keras3_api.py). Without patch 0008, 7 of the 15 cases fail (8 with hvdtrain
imported first)."""
import json

import pytest

from tests.helpers.kerases import needs_keras3
from tests.helpers.ranks import run_ranks

CASES = {
    "broadcast_variables_of_a_model_and_its_optimizer", "distributed_gradient_tape_averages_and_keeps_local_sources",
    "gradient_tape_loop_with_a_distributed_optimizer", "train_model_lr_schedule", "sparse_as_dense",
    "sparse_as_dense_with_grad_aggregation", "grad_aggregation_with_inf_grad", "from_config", "elastic_state",
    "gradient_aggregation_averaged", "gradient_aggregation_summed", "gradient_aggregation_with_local_vars_averaged",
    "gradient_aggregation_with_local_vars_summed", "partial_distributed_optimizer",
    "broadcast_global_variables_callback_with_local_vars"}


@needs_keras3
@pytest.mark.parametrize("order", ["horovod-alone", "hvdtrain-first"])
def test_each_behaviour_of_horovods_keras_suite_on_keras_3(tmp_path, order):
    """``hvdtrain-first``: tf.keras is then Keras 2 (hvdtrain sets TF_USE_LEGACY_KERAS), so
    horovod.tensorflow.keras's callbacks are tf_keras ones, given to Keras 3's fit."""
    # TensorFlow's own choice (tf.keras is Keras 3) unless hvdtrain is imported first; this process set it.
    env = {"TF_USE_LEGACY_KERAS": "0"} if order == "horovod-alone" else {}
    result = run_ranks(2, ["-m", "tests.workers.horovod_keras3_api", str(tmp_path), order], env=env, timeout=300)
    assert f"tf.keras is Keras {2 if order == 'hvdtrain-first' else 3}" in result.stdout
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(results) == CASES
        failed = {case: error for case, error in results.items() if error != "ok"}
        assert not failed, f"rank {rank}: {json.dumps(failed, indent=1)}"
