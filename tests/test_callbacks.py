"""Callbacks that need no ranks: the progress bar, metrics.jsonl and TensorBoard on a resumed run, the
elastic commit's timeline."""
import io
import json
import time

import numpy as np

from hvdtrain.callbacks import (Callback, ElasticCommit, EpochLine, JsonlMetrics, ProgressBar, TensorBoard, close_all,
                                logged_epochs)
from hvdtrain.position import TrainPosition
from tests.helpers.logs import tensorboard_scalars


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


def test_the_epoch_line_is_one_write_with_its_newline(monkeypatch):
    """Unbuffered (PYTHONUNBUFFERED), a separate write of the newline reaches mpirun as a chunk of
    its own, which it tags as a line: the line and its newline must go out in one write."""
    writes = []

    class Recorder(io.StringIO):
        def write(self, text):
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr("sys.stdout", Recorder())
    EpochLine(12).on_epoch_end(2, {"train_loss": 0.5, "train_accuracy": 0.8, "test_loss": 0.6, "test_accuracy": 0.75,
                                   "images_per_sec": 1900.0, "epoch_time_s": 31.5, "lr": 0.09})
    assert writes == ["epoch   3/12  train loss 0.5000 acc 0.8000  test loss 0.6000 acc 0.7500  1,900 img/s  31.5 s  "
                      "lr 0.09\n"]


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


def _tensorboard_run(log_dir, start_epoch, first_step, epochs, steps, value, restart_markers=True):
    """Log epochs ``start_epoch`` ... ``epochs - 1`` (the first from ``first_step``) as the trainer
    calls the callback, every step's running metrics and every epoch's metrics equal to ``value``."""
    board = TensorBoard(str(log_dir), steps_per_epoch=steps, restart_markers=restart_markers)
    for epoch in range(start_epoch, epochs):
        first = first_step if epoch == start_epoch else 0
        board.on_epoch_begin(epoch, steps, first)
        for step in range(first, steps):
            board.on_step_end(epoch, step, {"loss": value, "accuracy": value})
        board.on_epoch_end(epoch, {"test_accuracy": value})
    board.close()


def test_tensorboard_shows_a_resumed_run_once(tmp_path):
    """The interrupted run logged 3 epochs of 4 steps; the resumed one restarts at step 2 of epoch 2
    (a mid-epoch checkpoint). TensorBoard must show every step and epoch once, the resumed run's
    values from there on."""
    _tensorboard_run(tmp_path, start_epoch=0, first_step=0, epochs=3, steps=4, value=1.0)
    time.sleep(1.1)  # a later event file, as a real resume makes (the file name holds the time in seconds)
    _tensorboard_run(tmp_path, start_epoch=1, first_step=2, epochs=4, steps=4, value=2.0)
    steps = tensorboard_scalars(tmp_path / "tensorboard" / "steps")
    assert set(steps) == {"running/loss", "running/accuracy"}
    assert steps["running/loss"] == [(s, 1.0) for s in range(1, 7)] + [(s, 2.0) for s in range(7, 17)]
    epochs = tensorboard_scalars(tmp_path / "tensorboard" / "epochs")
    assert epochs == {"epoch/test_accuracy": [(1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)]}


def test_tensorboard_writes_no_restart_markers_when_told(tmp_path):
    """An elastic job's global steps move with its world size: no marker may drop its points."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    _tensorboard_run(tmp_path, start_epoch=0, first_step=0, epochs=2, steps=3, value=1.0, restart_markers=False)
    events = [e for axis in ("steps", "epochs") for path in (tmp_path / "tensorboard" / axis).iterdir()
              for e in LegacyEventFileLoader(str(path)).Load()]
    assert events and not any(e.HasField("session_log") for e in events)
    assert tensorboard_scalars(tmp_path / "tensorboard" / "epochs") == {"epoch/test_accuracy": [(1, 1.0), (2, 1.0)]}


class _Closing(Callback):
    def __init__(self, error=None):
        self.error, self.closed = error, False

    def close(self):
        self.closed = True
        if self.error:
            raise self.error


def test_close_all_closes_every_callback_and_warns_of_a_failure(capsys):
    callbacks = [_Closing(OSError(28, "No space left on device")), _Closing()]
    close_all(callbacks)
    assert all(cb.closed for cb in callbacks)
    assert capsys.readouterr().err == ("hvdtrain: warning: closing _Closing failed: OSError: [Errno 28] No space left "
                                       "on device\n")


class _ElasticState:
    """What :class:`hvdtrain.callbacks.ElasticCommit` uses of the elastic training state."""

    def __init__(self):
        self.saves, self.host_checks = [], 0

    def save(self):
        p = self.position
        self.saves.append((p.epoch, p.example, list(p.epoch_sums) if p.epoch_sums else None))

    def check_host_updates(self):
        self.host_checks += 1


def test_elastic_commits_at_every_checkpoint_and_epoch_end_and_checks_hosts_after_agreement():
    """Every mid-epoch checkpoint commits, at the next example of the epoch's permutation, so a
    rollback never returns to a state older than a checkpoint on disk and the checkpoints stay one
    timeline; each epoch end commits the next epoch's start. Workers that joined or left are looked
    for once per commit, after the ranks agree on rank 0's writes, except at the last epoch's end,
    where the job ends."""
    state = _ElasticState()
    commit = ElasticCommit(state, epochs=2)  # 100 examples, global batch 10
    commit.on_save_point(TrainPosition(0, 3, 30, np.array([1.5, 2.0, 30.0])))
    assert state.saves == [(0, 30, [1.5, 2.0, 30.0])] and state.host_checks == 0
    commit.after_agreement()
    commit.after_agreement()
    assert state.host_checks == 1
    commit.on_epoch_end(0, {})
    commit.after_agreement()
    assert state.saves[-1] == (1, 0, None) and state.host_checks == 2
    commit.on_save_point(TrainPosition(1, 7, 70, np.array([0.5, 1.0, 70.0])))
    commit.after_agreement()
    assert state.host_checks == 3
    commit.on_epoch_end(1, {})
    commit.after_agreement()
    assert [s[:2] for s in state.saves] == [(0, 30), (1, 0), (1, 70), (2, 0)]
    assert state.host_checks == 3  # the last commit looks for no workers


def test_history_keeps_one_entry_per_epoch_when_an_epoch_is_trained_again():
    """An elastic job rolled back past an epoch's end trains it again: the second result replaces the first."""
    from hvdtrain.callbacks import History

    history = History()
    for epoch, loss in ((0, 1.0), (1, 0.5), (1, 0.4), (2, 0.3)):
        history.on_epoch_end(epoch, {"train_loss": loss})
    assert history.epochs == [0, 1, 2] and [h["train_loss"] for h in history.history] == [1.0, 0.4, 0.3]
