"""Which Keras a process trains: the user's objects decide, one Keras per process, clear errors otherwise."""
import re
import subprocess
import sys

import pytest

from hvdtrain import kerases
from hvdtrain.errors import HvdtrainError
from tests.helpers.ranks import REPO
from tests.helpers.kerases import KERAS_3, needs_keras3


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, with none of this process's Keras choice (hvdtrain's import here set it)."""
    import os

    inherited = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "KERAS_BACKEND")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**inherited, "TF_CPP_MIN_LOG_LEVEL": "2", **env})


def test_importing_hvdtrain_keeps_tf_keras_keras_2():
    """Code written for tf.keras keeps the Keras 2 it was written for; `import keras` is Keras 3."""
    proc = _python("import hvdtrain, tensorflow as tf; from hvdtrain import kerases; "
                   "print(kerases.version_of(tf.keras.layers.Dense(1)), kerases.default_version())")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == (["2", "3"] if KERAS_3 else ["2", "2"])


def test_objects_decide_and_the_default_is_tensorflows():
    import tensorflow as tf

    assert kerases.choose(0) == kerases.default_version() == (3 if KERAS_3 else 2)
    assert kerases.choose(2) == 2
    assert kerases.choose(0, model=tf.keras.Sequential(), optimizer=None) == 2
    assert kerases.version_of(tf.keras.optimizers.SGD()) == 2 and kerases.version_of("text") is None


@needs_keras3
def test_two_kerases_in_one_process_are_one_clear_error():
    import keras
    import tensorflow as tf

    from tests.helpers.models import keras3_mlp, keras3_with_a_keras2_layer

    model = keras3_mlp((4, 4, 1), 3)
    with pytest.raises(HvdtrainError, match=r"the model \(keras\.src\.models\.sequential\.Sequential\) is Keras 3 but "
                                            r"the optimizer \(tf_keras\.src\.optimizers\.sgd\.SGD\) is Keras 2: build "
                                            r"every object with one Keras"):
        kerases.choose(0, model=model, optimizer=tf.keras.optimizers.SGD())
    with pytest.raises(HvdtrainError, match=r"the callbacks\[1\] \(tf_keras\.src\.callbacks\.EarlyStopping\) is Keras 2"):
        kerases.choose(0, model=model, callbacks=[keras.callbacks.CSVLogger("x"), tf.keras.callbacks.EarlyStopping()])
    with pytest.raises(HvdtrainError, match=r"--keras 2, but the model \(keras\.src\.models\.sequential\.Sequential\) "
                                            r"is Keras 3: give --keras 3 or leave it out"):
        kerases.choose(2, model=model)
    with pytest.raises(HvdtrainError, match=r"the model's attribute 'head' \(tf_keras\.src\.layers\.core\.dense\.Dense\) "
                                            r"is Keras 2"):
        kerases.choose(0, model=keras3_with_a_keras2_layer((4, 4, 1), 3))


@needs_keras3
def test_keras_3_on_another_backend_is_one_clear_error():
    proc = _python("import hvdtrain; hvdtrain.keras3", KERAS_BACKEND="jax")
    assert proc.returncode != 0
    # "cannot start" where jax is not installed (here), "runs on" where it is
    assert re.search(r"HvdtrainError: Keras 3 (cannot start|runs on) its 'jax' backend", proc.stderr), proc.stderr[-2000:]
    assert "set KERAS_BACKEND=tensorflow" in proc.stderr


@pytest.mark.skipif(KERAS_3, reason="TensorFlow >= 2.16 has Keras 3")
def test_keras_3_where_there_is_none_is_one_clear_error():
    with pytest.raises(HvdtrainError, match=r"Keras 3 needs TensorFlow >= 2\.16"):
        kerases.choose(3)


@needs_keras3
def test_tf_keras_used_before_importing_hvdtrain_trains_keras_3():
    """tf.keras chooses its Keras at its first use: before `import hvdtrain` that is Keras 3, which
    hvdtrain now trains (it used to be refused)."""
    proc = _python("import numpy as np, tensorflow as tf\n"
                   "model = tf.keras.Sequential([tf.keras.Input((8, 8)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(2)])\n"
                   "import hvdtrain\n"
                   "result = hvdtrain.fit(lambda input_shape, num_classes: model,"
                   " (np.zeros((8, 8, 8), np.uint8), np.arange(8) % 2) * 2, epochs=1, batch_size=4, log={'progress': False})\n"
                   "print(type(result.model).__module__, sorted(result.metrics)[:2])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("keras.src."), proc.stdout


def test_each_kerass_layer_by_a_clear_name_and_the_default_kerass_at_the_top():
    """hvdtrain.keras2 and hvdtrain.keras3 hold the layer of each Keras; hvdtrain.SyncBatchNormalization
    is the layer of TensorFlow's default Keras (Keras 3 where it is installed)."""
    import hvdtrain
    from hvdtrain import kerases

    assert kerases.version_of(hvdtrain.keras2.SyncBatchNormalization) == 2
    assert kerases.version_of(hvdtrain.keras2.SeededDropout) == kerases.version_of(hvdtrain.keras2.WarmupSchedule) == 2
    default = hvdtrain.keras3 if kerases.keras3_installed() else hvdtrain.keras2
    assert hvdtrain.SyncBatchNormalization is default.SyncBatchNormalization
    if kerases.keras3_installed():
        assert kerases.version_of(hvdtrain.keras3.SyncBatchNormalization) == 3
