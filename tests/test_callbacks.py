"""Rank 0's callbacks that need no ranks: the progress bar, metrics.jsonl on a resumed run."""
import io
import json

from hvdtrain.callbacks import JsonlMetrics, ProgressBar, logged_epochs


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


def test_a_resumed_run_drops_the_epochs_after_its_checkpoint_and_a_cut_line(tmp_path):
    """The interrupted run logged epochs 1-3 and began a fourth line; the checkpoint is of epoch 2."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"epoch": 1, "x": 1}\n{"epoch": 2, "x": 2}\n[3]\n{"epoch": 3, "x": 3}\n{"epoch": 4, "x"')
    assert [epoch for epoch, _ in logged_epochs(str(path))] == [1, 2, 3]
    metrics = JsonlMetrics(str(tmp_path))
    metrics.on_train_begin(start_epoch=2, epochs=5)
    metrics.on_epoch_end(2, {"x": 30})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"epoch": 1, "x": 1}, {"epoch": 2, "x": 2}, {"epoch": 3, "x": 30}]
