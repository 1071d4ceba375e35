"""Which Kerases this stack has, for tests that need Keras 3."""
import pytest

from hvdtrain import kerases

KERAS_3 = kerases.keras3_installed()
needs_keras3 = pytest.mark.skipif(not KERAS_3, reason="needs Keras 3 (TensorFlow >= 2.16)")
