"""pip install into an existing stack: a fresh venv that reuses the set-up's TensorFlow and Horovod
(as NVIDIA's containers ship them) installs hvdtrain from its source without downloading anything,
trains at two ranks (saying once that the CPU kernels are not built), then builds the kernels."""
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.helpers.ranks import REPO, rank_env

IGNORED = shutil.ignore_patterns(".git", ".venv*", "runs", "build", "*.egg-info", "__pycache__", "_sync_bn_kernels*")


def _run(args, cwd, timeout=600):
    env = {k: v for k, v in rank_env().items() if k != "PYTHONPATH"}  # this checkout must not be importable
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_pip_install_next_to_an_existing_tensorflow_and_horovod(tmp_path):
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=IGNORED)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path)
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path).stdout.strip())
    (site / "existing_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # TF, Horovod, numpy...
    # --no-index: every requirement setup.py declares must already be there; nothing is downloaded.
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation", source], tmp_path)
    where = _run([python, "-c", "import hvdtrain; print(hvdtrain.__file__)"], tmp_path).stdout.strip()
    assert where.startswith(str(site)), where

    run = _run([python, "-m", "horovod.runner.launch", "-np", "2", "-H", "localhost:2", "--gloo", python, "-m",
                "hvdtrain", "--dataset", "synthetic", "--epochs", "1", "--no-progress", "--log-dir", tmp_path / "run"],
               tmp_path)
    assert "epoch   1/1" in run.stdout
    assert (run.stdout + run.stderr).count("CPU kernels are not built") == 1
    assert (tmp_path / "run" / "model.keras").exists()

    _run([python, "-m", "hvdtrain.model.sync_bn_kernels"], tmp_path)
    _run([python, "-c", "from hvdtrain.model import sync_bn_kernels as k; assert k._library() is not None"], tmp_path)


def _setup(tmp_path, **env):
    """scripts/setup.sh on the stack this suite runs on (its venv, its STACK), logging into ``tmp_path``."""
    venv = Path(sys.prefix)
    stack = (venv / ".hvdtrain-stack").read_text().strip()
    return subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**rank_env(), "HVDTRAIN_VENV": str(venv), "STACK": stack,
                                            "HVDTRAIN_SETUP_LOG": str(tmp_path / "setup.log"), **env})


def test_setup_of_a_ready_stack_prints_one_line_and_logs_the_rest(tmp_path):
    done = _setup(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("[setup] ready: ") and done.stdout.count("\n") == 1, done.stdout
    assert f"log: {tmp_path / 'setup.log'}" in done.stdout


def test_a_failing_setup_phase_shows_the_logs_last_lines_and_its_path(tmp_path):
    """A phase that fails (here: no such Python for a new venv) names the line and shows the log's
    tail on stderr; the console got one line per phase before it."""
    done = _setup(tmp_path, HVDTRAIN_VENV=str(tmp_path / "venv"), PYTHON=str(tmp_path / "no-such-python"))
    assert done.returncode != 0
    assert all(line.startswith("[setup] ") for line in done.stdout.splitlines()), done.stdout
    assert f"failed (exit 127); the last lines of {tmp_path / 'setup.log'}:" in done.stderr, done.stderr
    assert "  | " in done.stderr and "no-such-python: No such file or directory" in done.stderr, done.stderr
