"""hvdtrain.console: what a rank prints."""
from hvdtrain.console import say


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
