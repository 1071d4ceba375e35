from hvdtrain.errors import describe_differences, say


def test_describe_differences_names_changed_missing_and_nested_keys_in_order():
    ours = {"a": 1, "b": 2, "c": {"x": 1, "y": "p"}, "d": 4}
    theirs = {"a": 1, "b": 3, "c": {"x": 1, "y": "q"}}
    assert describe_differences(ours, theirs, "on rank 0") == [
        "b: 2 here, 3 on rank 0", "c.y: 'p' here, 'q' on rank 0", "d: 4 here, None on rank 0"]
    assert describe_differences(ours, dict(ours), "there") == []


def test_say_writes_a_line_in_one_write_and_flushes():
    """One write per line: mpirun tags each chunk of a rank's output, so a newline written apart
    (as print() does when unbuffered) would become a line of its own with a tag glued before it."""
    class Stream:
        def __init__(self):
            self.writes, self.flushes = [], 0

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            self.flushes += 1

    stream = Stream()
    say("hvdtrain: error: --batch-size must be an integer >= 1, got 0", stream)
    assert stream.writes == ["hvdtrain: error: --batch-size must be an integer >= 1, got 0\n"]
    assert stream.flushes == 1
