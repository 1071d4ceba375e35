"""Keras 2 only: hvdtrain selects tf_keras before TensorFlow loads, and refuses Keras 3 clearly."""
import importlib.metadata
import subprocess
import sys

import pytest

from tests.ranks import REPO

KERAS_3 = int(importlib.metadata.version("keras").split(".")[0]) >= 3


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, with none of this process's Keras choice (hvdtrain's import here set it)."""
    import os

    inherited = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**inherited, "TF_CPP_MIN_LOG_LEVEL": "2", **env})


def test_importing_hvdtrain_makes_tf_keras_keras_2():
    proc = _python("import hvdtrain, tensorflow as tf; from hvdtrain.compat import require_keras2; require_keras2(); "
                   "print(type(tf.keras.layers.Dense(1)).__module__)")
    assert proc.returncode == 0, proc.stderr[-2000:]  # require_keras2 found tf.keras to be Keras 2
    if KERAS_3:  # TensorFlow >= 2.16: Keras 2 is the tf_keras package (TensorFlow 2.15's own is keras 2.15)
        assert proc.stdout.startswith("tf_keras."), proc.stdout


@pytest.mark.skipif(not KERAS_3, reason="TensorFlow <= 2.15: tf.keras is Keras 2 whatever TF_USE_LEGACY_KERAS says")
def test_a_tf_keras_that_is_keras_3_is_refused_naming_the_fix():
    proc = _python("import hvdtrain; from hvdtrain.compat import require_keras2; require_keras2()",
                   TF_USE_LEGACY_KERAS="0")
    assert proc.returncode != 0
    assert "tf.keras is Keras 3 here" in proc.stderr and "TF_USE_LEGACY_KERAS=1" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(not KERAS_3, reason="needs Keras 3 (TensorFlow >= 2.16)")
def test_a_keras_3_optimizer_is_refused():
    proc = _python("import hvdtrain, keras; from hvdtrain.compat import require_keras2; "
                   "require_keras2(optimizer=keras.optimizers.SGD())")
    assert proc.returncode != 0 and "the optimizer (keras.src.optimizers.sgd.SGD) is a Keras 3 object" in proc.stderr, \
        proc.stderr[-2000:]


@pytest.mark.skipif(not KERAS_3, reason="TensorFlow <= 2.15: tf.keras is Keras 2 whatever the order")
def test_tf_keras_used_before_importing_hvdtrain_is_one_clear_error():
    """tf.keras chooses its Keras at its first use: before `import hvdtrain` that is Keras 3, and
    hvdtrain.fit says so first, instead of failing deep inside."""
    proc = _python("import numpy as np, tensorflow as tf; tf.keras.layers.Dense(1)\n"
                   "import hvdtrain\n"
                   "hvdtrain.fit('cnn', (np.zeros((8, 8, 8), np.uint8), np.arange(8) % 2,) * 2, epochs=1)")
    assert proc.returncode != 0
    assert "HvdtrainError: tf.keras is Keras 3 here" in proc.stderr, proc.stderr[-2000:]
    assert "tf.keras was first used before `import hvdtrain`" in proc.stderr


@pytest.mark.skipif(not KERAS_3, reason="TensorFlow <= 2.15: tf.keras is Keras 2 whatever the order")
def test_the_layer_made_after_tf_keras_chose_keras_3_says_so():
    proc = _python("import tensorflow as tf; tf.keras.layers.Dense(1)\n"
                   "import hvdtrain\n"
                   "hvdtrain.SyncBatchNormalization()")
    assert proc.returncode != 0
    assert "HvdtrainError: tf.keras is Keras 3 here" in proc.stderr and "TypeError" not in proc.stderr, \
        proc.stderr[-2000:]
