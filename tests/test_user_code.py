"""hvdtrain.user_code: a user's package.module:function, imported, or one error naming the flag."""
import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.user_code import import_function, name_of
from tests.helpers import datafns


def test_a_function_is_imported_by_its_spec():
    assert import_function("tests.helpers.datafns:counted", "--data") is datafns.counted


@pytest.mark.parametrize("spec, message", [
    ("tests.helpers.datafns", "expected 'package.module:function'"),
    ("no_such_module_here:f", "cannot import module 'no_such_module_here' (ModuleNotFoundError"),
    ("tests.helpers.datafns:no_such_function", "module 'tests.helpers.datafns' has no function 'no_such_function'"),
])
def test_a_bad_spec_is_one_error_naming_the_flag(spec, message):
    with pytest.raises(HvdtrainError) as e:
        import_function(spec, "--model")
    assert str(e.value).startswith(f"--model {spec!r}: ") and message in str(e.value)


def test_name_of_a_part_is_its_spec_its_name_or_its_type():
    assert name_of("pkg.mod:fn") == "pkg.mod:fn"
    assert name_of(datafns.counted) == "counted"
    assert name_of(object()) == "object"
