"""Run files (``--config``, ``--print-config``, ``<log-dir>/config.yaml``): the defaults, then the
file, then the flags given; one error naming the file and the key for a bad file."""
import json
import subprocess
import sys

import pytest
import yaml

from hvdtrain.cli import parse_command_line
from hvdtrain.config import Config
from hvdtrain.config_file import config_to_yaml
from hvdtrain.errors import HvdtrainError
from tests.helpers.ranks import rank_env, run_ranks


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_print_config_shows_the_defaults_and_reads_back_to_them(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hvdtrain", "--print-config"], capture_output=True, text=True,
                         env=rank_env(), check=True).stdout
    assert yaml.safe_load(out) == Config().to_dict()
    assert parse_command_line(["--config", write(tmp_path, out)]) == (Config(), False)


def test_the_file_overrides_the_defaults_and_given_flags_override_the_file(tmp_path):
    path = write(tmp_path, "epochs: 3\nbatch_size: 32\noptim:\n  base_lr: 1e-3\n  momentum: 0\n"
                           "model: {sync_bn: false}\nlog: {dir: null}\n")
    config, print_config = parse_command_line(["--config", path, "--epochs", "5", "--momentum", "0.5"])
    assert not print_config
    assert (config.epochs, config.batch_size) == (5, 32)
    # 1e-3 is a string to YAML 1.1 and 0 an int: both become the float setting.
    assert (config.optim.base_lr, config.optim.momentum) == (1e-3, 0.5)
    assert config.model.sync_bn is False  # a flag not given (--no-sync-bn) leaves the file's value
    assert config.optim.warmup_epochs == Config().optim.warmup_epochs


def test_a_flag_given_at_its_default_still_overrides_the_file(tmp_path):
    path = write(tmp_path, "batch_size: 32\n")
    assert parse_command_line(["--config", path, "--batch-size", "128"])[0].batch_size == 128


@pytest.mark.parametrize("text, message", [
    ("epochs: 1\nbatchsize: 64\n", "unknown key 'batchsize'; did you mean 'batch_size'?"),
    ("optim: {lr: 0.1}\n", "unknown key 'optim.lr'; known keys of optim: backward_passes_per_step, base_lr"),
    ("epochs: ten\n", "epochs must be an integer, got 'ten'"),
    ("epochs: 1.5\n", "epochs must be an integer, got 1.5"),
    ("model: {sync_bn: 1}\n", "model.sync_bn must be true or false, got 1"),
    ("log: {dir: 7}\n", "log.dir must be a string or null, got 7"),
    ("optim: 0.1\n", "optim must be a mapping of its settings (name, base_lr, momentum,"),
    ("- epochs\n", "must be a mapping of settings (epochs: 12, optim: {...}, ...), got list"),
    ("epochs: [1,\n", "is not valid YAML"),
    ("batch_size: 0\n", "batch_size (--batch-size) must be an integer >= 1, got 0"),
])
def test_a_bad_file_is_one_error_naming_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(HvdtrainError) as e:
        parse_command_line(["--config", path])
    assert message in str(e.value) and path in str(e.value)


def test_a_bad_flag_over_a_file_names_the_flag(tmp_path):
    with pytest.raises(HvdtrainError, match=r"^--batch-size must be an integer >= 1, got 0$"):
        parse_command_line(["--config", write(tmp_path, "epochs: 1\n"), "--batch-size", "0"])


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(HvdtrainError, match="cannot read config file .*nowhere.yaml: No such file"):
        parse_command_line(["--config", str(tmp_path / "nowhere.yaml")])


def test_a_run_records_its_settings_and_runs_again_from_them(tmp_path):
    """np=2 from a file plus a flag: <log-dir>/config.yaml holds the settings the run ran with,
    and it reads back to the same config."""
    path = write(tmp_path, "epochs: 1\nbatch_size: 64\ndata: {dataset: synthetic}\nmodel: {name: 'tests.helpers.models:mlp'}\n"
                           "optim: {lr_schedule: constant}\nlog: {progress: false}\nruntime: {threads: 1}\n")
    run_dir = tmp_path / "run"
    run_ranks(2, ["-m", "hvdtrain", "--config", path, "--seed", "3", "--log-dir", str(run_dir)], launcher="gloo")
    written = (run_dir / "config.yaml").read_text()
    expected = parse_command_line(["--config", path, "--seed", "3", "--log-dir", str(run_dir)])[0]
    assert written == config_to_yaml(expected)
    assert parse_command_line(["--config", str(run_dir / "config.yaml")])[0] == expected
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["epoch"] == 1


