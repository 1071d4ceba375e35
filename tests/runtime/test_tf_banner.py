"""TensorFlow imported without its start-up banner: the banner's lines are left out, every other
line of the import's stderr comes through, and TF_CPP_MIN_LOG_LEVEL=0 asks for the banner."""
import subprocess
import sys

from hvdtrain.runtime.tf_banner import without_banner
from tests.helpers.ranks import REPO, rank_env

BANNER = (
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    "I0000 00:00:1796610353.061643    8845 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders. To "
    "turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n"
    "I0000 00:00:1796610353.116731    8845 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    "available CPU instructions in performance-critical operations.\n"
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.\n"
)


def test_the_banners_lines_are_left_out_and_the_others_kept():
    other = "E0000 00:00:1.0  1 cuda_dnn.cc:8] Unable to register cuDNN factory\nUserWarning: yours\n"
    assert without_banner(BANNER) == ""
    assert without_banner(BANNER + other) == other


def _stderr(code, level):
    # oneDNN as TensorFlow sets it here (on, where the CPU has AVX-512 VNNI): its banner line too.
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=rank_env({"TF_CPP_MIN_LOG_LEVEL": level, "TF_ENABLE_ONEDNN_OPTS": None})).stderr


QUIET = ("import sys; from hvdtrain.runtime.tf_banner import import_tensorflow; import_tensorflow(); "
         "print('after the import', file=sys.stderr)")


def test_importing_tensorflow_prints_nothing_of_its_banner():
    assert _stderr(QUIET, "1") == "after the import\n"


def test_log_level_0_asks_for_the_banner():
    """Then the import prints what a plain ``import tensorflow`` does (whatever this CPU's banner is)."""
    plain = _stderr("import tensorflow", "0").splitlines()
    assert len(_stderr(QUIET, "0").splitlines()) == len(plain) + 1
