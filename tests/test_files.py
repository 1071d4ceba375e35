"""hvdtrain.files: a file replaced whole, and a file in the way of a directory refused."""
import os

import pytest

from hvdtrain.errors import HvdtrainError
from hvdtrain.files import refuse_a_file_in_the_way, replace_file


def test_replace_file_leaves_the_new_text_and_no_temporary(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old")
    replace_file(str(path), "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["config.yaml"]


def test_a_file_in_the_way_of_a_directory_is_named(tmp_path):
    (tmp_path / "runs").write_text("")
    refuse_a_file_in_the_way(str(tmp_path / "elsewhere" / "a"), "--log-dir", "--log-dir")
    with pytest.raises(HvdtrainError, match=r"--log-dir .*/runs/a: .*/runs is a file, not a directory \(--log-dir\)"):
        refuse_a_file_in_the_way(str(tmp_path / "runs" / "a"), "--log-dir", "--log-dir")
