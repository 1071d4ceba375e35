"""hvdtrain.errors: messages that say what differs."""
from hvdtrain.errors import describe_differences


def test_describe_differences_names_changed_missing_and_nested_keys_in_order():
    ours = {"a": 1, "b": 2, "c": {"x": 1, "y": "p"}, "d": 4}
    theirs = {"a": 1, "b": 3, "c": {"x": 1, "y": "q"}}
    assert describe_differences(ours, theirs, "on rank 0") == [
        "b: 2 here, 3 on rank 0", "c.y: 'p' here, 'q' on rank 0", "d: 4 here, None on rank 0"]
    assert describe_differences(ours, dict(ours), "there") == []


