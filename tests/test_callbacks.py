"""Rank 0's callbacks that need no ranks: the progress bar."""
import io

from hvdtrain.callbacks import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _one_epoch(monkeypatch, stream) -> str:
    monkeypatch.setattr("sys.stderr", stream)
    bar = ProgressBar()
    bar.on_epoch_begin(0, steps=3)
    for step in range(3):
        bar.on_step_end(0, step, {"loss": 1.0, "accuracy": 0.5})
    bar.on_epoch_end(0, {})
    return stream.getvalue()


def test_progress_bar_draws_on_a_terminal(monkeypatch):
    assert "epoch 1" in _one_epoch(monkeypatch, _Terminal())


def test_progress_bar_stays_silent_in_a_log_file(monkeypatch):
    """Under a launcher or in a batch job's log, redraws would pile up as lines."""
    assert _one_epoch(monkeypatch, io.StringIO()) == ""
