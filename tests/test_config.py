"""hvdtrain.config: each setting's declared range, and the rules between settings, as one error naming the flag."""
import dataclasses

import pytest

from hvdtrain.cli import parse_command_line
from hvdtrain.config import Config, ConfigError, declared_settings
from hvdtrain.errors import HvdtrainError

# A value each kind of setting refuses (a bool where a number goes is refused too).
OUT_OF_RANGE = {"an integer >= 0": -1, "an integer >= 1": 0, "finite and >= 0": float("nan"),
                "finite and > 0": 0.0, "in [0, 1)": 1.0, "an integer in [0, 2^31)": 2**31,
                "an integer in [0, 19]": 20, "true or false": 1}
# Settings whose refused values are their own: (value, the section's other settings it needs).
OWN_BAD_VALUE = {"data.function": ("no-colon", {"dataset": "function"}), "model.name": (" ", {}),
                 "task.metrics": (7, {})}


@pytest.mark.parametrize("key", [key for key, field, _ in declared_settings() if field.metadata["requires"]])
def test_every_declared_range_refuses_a_value_outside_it_naming_the_flag(key):
    field = next(f for k, f, _ in declared_settings() if k == key)
    requirement = field.metadata["requires"]
    bad, others = OWN_BAD_VALUE.get(key, (OUT_OF_RANGE.get(requirement.text, "no such value"), {}))
    section, _, name = key.rpartition(".")
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(getattr(Config(), section) if section else Config(), **{name: bad, **others})
    assert e.value.flag == field.metadata["flag"] and e.value.requirement == requirement.text
    assert str(e.value) == f"{field.metadata['flag']} must be {requirement.text}, got {bad!r}"
    assert requirement.holds(field.default) or field.default is None


# Settings that conflict or are out of range, as flags: one error (argparse's for a bad choice).
@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "rmsprop"], "argument --optimizer: invalid choice: 'rmsprop'"),
    (["--optimizer", "adamw"], "--optimizer adamw needs --weight-decay > 0"),
    (["--optimizer", "adam", "--nesterov"], "--nesterov applies to --optimizer sgd, not adam"),
    (["--weight-decay", "-0.1"], "--weight-decay must be finite and >= 0, got -0.1"),
    (["--clip-norm", "inf"], "--clip-norm must be finite and >= 0, got inf"),
    (["--optimizer", "adam", "--weight-decay", "0.1"], "--optimizer adam with --weight-decay is AdamW"),
    (["--optimizer", "adam", "--backward-passes-per-step", "2"],
     "--optimizer adam cannot be combined with --backward-passes-per-step 2"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--precision", "fp64", "--fp16-allreduce"], "--precision fp64 cannot be combined with --fp16-allreduce"),
    (["--precision", "fp16", "--backward-passes-per-step", "2"],
     "--precision fp16 cannot be combined with --backward-passes-per-step 2"),
    (["--eval-batch-size", "-1"], "--eval-batch-size must be an integer >= 0, got -1"),
])
def test_bad_settings_are_one_error(flags, message, capsys):
    with pytest.raises((HvdtrainError, SystemExit)) as e:
        parse_command_line(flags)
    assert message in (str(e.value) if isinstance(e.value, HvdtrainError) else capsys.readouterr().err)


def test_evaluation_batches_are_the_local_batch_unless_set():
    """An evaluation batch's activations are held at once: by default no more than a training step's."""
    assert parse_command_line(["--batch-size", "32"])[0].eval_batch_size == 32
    assert parse_command_line(["--batch-size", "32", "--eval-batch-size", "500"])[0].eval_batch_size == 500
