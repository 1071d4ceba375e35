"""hvdtrain: data-parallel TensorFlow 2 training on Horovod.

Installs into an environment that has TensorFlow and Horovod already (Horovod must be built against
that TensorFlow: scripts/setup.sh does both; NVIDIA's containers ship both). Build without isolation,
so that the TensorFlow installed is the one seen here:

    pip install --no-build-isolation .
    python -m hvdtrain.model.sync_bn_kernels   # optional: SyncBatchNormalization's single-pass CPU kernels
"""
import importlib.metadata
import os

from setuptools import find_packages, setup


def tf_keras_requirement() -> list:
    """``tf-keras`` of the installed TensorFlow's minor version, where TensorFlow >= 2.16 (whose own Keras is
    Keras 3) is installed as the distribution ``tensorflow``. Not for ``tensorflow-cpu``: tf-keras requires
    ``tensorflow`` by that name, which pip would then install beside it (scripts/setup.sh installs tf-keras
    with --no-deps there)."""
    try:
        major, minor = (int(part) for part in importlib.metadata.version("tensorflow").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return []
    return [f"tf-keras>={major}.{minor},<{major}.{minor + 1}"] if (major, minor) >= (2, 16) else []


setup(
    name="hvdtrain",
    version="0.1.0",
    description="Data-parallel deep-learning training on Horovod and TensorFlow 2",
    long_description=open("README.md", encoding="utf-8").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",  # as scripts/setup.sh's stacks: TF 2.15 on 3.10-3.11, TF 2.21 on 3.10-3.13
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    package_data={"hvdtrain.model": ["csrc/*.cc"]},  # compiled against the installed TensorFlow (above)
    # TensorFlow and Horovod are not required here: they come as a built pair (see above).
    install_requires=["numpy", "tqdm", "PyYAML", "matplotlib", "tensorboard", "psutil", *tf_keras_requirement()],
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.cli:main"]},
)
