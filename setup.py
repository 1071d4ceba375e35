"""hvdtrain: data-parallel TensorFlow 2 training on Horovod."""
from setuptools import find_packages, setup

setup(
    name="hvdtrain",
    version="0.1.0",
    description="Data-parallel deep-learning training on Horovod and TensorFlow 2",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    package_data={"hvdtrain.model": ["csrc/*.cc"]},  # compiled at set-up against the installed TensorFlow
    # TensorFlow and Horovod are installed by scripts/setup.sh (Horovod must be built against TF).
    install_requires=["numpy", "tqdm", "PyYAML"],
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.cli:main"]},
)
