"""The command line with real ranks: help, argument errors, the real job end to end, resume."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.logs import tensorboard_scalars
from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import REPO, command, rank_env, run_ranks
from tests.helpers.runs import hvdtrain, metrics

FAST = ["--dataset", "synthetic", "--model", "tests.helpers.models:mlp", "--batch-size", "64", "--no-progress",
        "--threads", "1"]


def checkpoint_weights(checkpoint_dir):
    """{key: array} of the model variables in the newest checkpoint of a run."""
    latest = sorted(p for p in checkpoint_dir.iterdir() if p.name.startswith("ckpt-"))[-1]
    reader = tf.train.load_checkpoint(str(latest / "state"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k.startswith("model/")}


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "hvdtrain", "--help"], capture_output=True, text=True,
                         env=rank_env(), check=True).stdout
    for flag in ["--epochs", "--batch-size", "--lr", "--warmup-epochs", "--dataset", "--data-dir", "--model",
                 "--checkpoint-dir", "--resume", "--seed", "--log-dir", "--threads", "--no-sync-bn",
                 "--fp16-allreduce", "--backward-passes-per-step", "--optimizer", "--nesterov", "--weight-decay",
                 "--clip-norm"]:
        assert flag in out
    assert "(default: 128)" in out and "per rank" in out


def test_resume_continues_exactly(tmp_path):
    """Stopped after epoch 1 and resumed == uninterrupted (constant learning rate), same metrics layout."""
    common = [*FAST, "--lr-schedule", "constant", "--warmup-epochs", "0.5"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    hvdtrain(2, [*common, "--epochs", "2", "--log-dir", str(whole)])
    hvdtrain(2, [*common, "--epochs", "1", "--log-dir", str(split)])
    resumed = hvdtrain(2, [*common, "--epochs", "2", "--log-dir", str(split), "--resume"])
    assert "epochs 2..2" in resumed.stdout
    # Only the epoch count differs from the checkpointed run, and the resumed run says so.
    assert resumed.stdout.count("--resume: settings changed since ckpt-") == 1
    assert "ckpt-000047: epochs: 2 here, 1 there\n" in resumed.stdout

    assert [m["epoch"] for m in metrics(split)] == [1, 2]
    assert [sorted(m) for m in metrics(split)] == [sorted(m) for m in metrics(whole)]
    a, b = checkpoint_weights(whole / "checkpoints"), checkpoint_weights(split / "checkpoints")
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert metrics(split)[-1]["test_accuracy"] == pytest.approx(metrics(whole)[-1]["test_accuracy"], abs=1e-3)


STOPPED = "hvdtrain: stopped by"


def test_a_sigterm_while_a_finished_run_closes_its_logs_is_only_recorded(tmp_path):
    """The run has trained and checkpointed; a SIGTERM while it closes its logs must not turn it
    into a stopped run (exit 143) nor leave the logs half-closed."""
    result = run_ranks(1, ["-m", "tests.workers.sigterm_while_closing", *FAST, "--epochs", "1",
                           "--log-dir", str(tmp_path)], launcher="single", check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert STOPPED not in result.stderr
    assert [m["epoch"] for m in metrics(tmp_path)] == [1]
    assert tensorboard_scalars(tmp_path / "tensorboard" / "epochs")["epoch/test_accuracy"][0][0] == 1


@pytest.mark.parametrize("launcher, sig, status", [
    ("single", signal.SIGINT, 130),
    ("single", signal.SIGTERM, 75),
    # Launchers pass Ctrl-C (SIGINT) and scancel's SIGTERM on to every rank as SIGTERM, one by one.
    ("mpirun", signal.SIGINT, None),
    ("gloo", signal.SIGTERM, None),
])
def test_a_stopped_run_prints_one_line_and_keeps_the_checkpoints(tmp_path, launcher, sig, status):
    """Ctrl-C or SIGTERM after the first epoch's checkpoint: one line on stderr from rank 0, no
    traceback from any rank, non-zero status (130 on Ctrl-C; 75 on SIGTERM, after every rank
    stopped at one step and rank 0 checkpointed it), and the run resumes from its checkpoint."""
    np_ = 1 if launcher == "single" else 2
    # Epochs of this model take 0.15 s: enough of them that the run is still going when the
    # signal comes, however slowly this test gets to send it.
    args = ["-m", "hvdtrain", *FAST, "--epochs", "100000", "--log-dir", str(tmp_path)]
    proc = subprocess.Popen(command(np_, args, launcher), cwd=REPO, env=rank_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in proc.stdout:  # horovodrun prefixes each line with the rank
            if "epoch   1/100000" in line:
                break
        while not list((tmp_path / "checkpoints").glob("ckpt-*")):
            assert proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status if status else proc.returncode != 0, (proc.returncode, err)
    if sig == signal.SIGINT and launcher == "single":
        line = (f"hvdtrain: interrupted; the checkpoints written so far are complete: rerun the same command "
                f"with --resume --log-dir {tmp_path} to continue from the last one\n")
        printed = err.count(line)
    else:
        printed = len(re.findall(rf"hvdtrain: stopped by SIGTERM after epoch \d+(, step \d+ of \d+)?, every rank "
                                 rf"there, and checkpointed it: rerun the same command with --resume --log-dir "
                                 rf"{tmp_path} to continue from there", err))
    # Under mpirun rank 0 may be waiting in a shared-memory collective when its peer stops, and
    # then never returns to Python to print before mpirun kills it.
    assert printed == 1 or (launcher == "mpirun" and printed == 0), err
    assert "stderr>:Traceback" not in err and (launcher == "gloo" or "Traceback" not in err), err
    resumed = hvdtrain(np_, [*FAST, "--epochs", "1", "--log-dir", str(tmp_path), "--resume"], launcher=launcher)
    assert "no epoch left to train of 1 (evaluation only)" in resumed.stdout, resumed.stdout


def test_an_evaluation_only_run_records_its_test_metrics(tmp_path, trained_mlp_run):
    """--resume with no epoch left: the test metrics of the checkpoint go to evaluation.json (the
    same as the last epoch's, from the same weights), and metrics.jsonl is left as it was."""
    tmp_path = shutil.copytree(trained_mlp_run, tmp_path / "run")  # one epoch of FAST at np=2
    logged = (tmp_path / "metrics.jsonl").read_text()
    # --epochs 0 (or 1): nothing left to train; not a changed setting worth a warning
    result = hvdtrain(2, [*FAST, "--epochs", "0", "--log-dir", str(tmp_path), "--resume"])
    assert "settings changed" not in result.stdout, result.stdout
    evaluation = json.loads((tmp_path / "evaluation.json").read_text())
    (last,) = metrics(tmp_path)
    assert evaluation["epoch"] == 1 and evaluation["step_in_epoch"] == 0 and evaluation["world_size"] == 2
    assert evaluation["test_accuracy"] == pytest.approx(last["test_accuracy"], abs=1e-6)
    assert evaluation["test_loss"] == pytest.approx(last["test_loss"], rel=1e-5)
    assert f"test loss {evaluation['test_loss']:.4f} acc {evaluation['test_accuracy']:.4f}" in result.stdout
    assert (tmp_path / "metrics.jsonl").read_text() == logged
    assert not list(tmp_path.glob("*.tmp"))


def test_a_fresh_run_with_no_epochs_evaluates_the_initial_weights(tmp_path):
    """--epochs 0 on a new run: the test metrics of the initial weights go to evaluation.json,
    at position epoch 0, step 0, and no epoch is logged."""
    result = hvdtrain(1, [*FAST, "--epochs", "0", "--log-dir", str(tmp_path)], launcher="single")
    evaluation = json.loads((tmp_path / "evaluation.json").read_text())
    assert {k: evaluation[k] for k in ("epoch", "step_in_epoch", "example_in_epoch", "world_size")} == {
        "epoch": 0, "step_in_epoch": 0, "example_in_epoch": 0, "world_size": 1}
    # Chance level (no class holds over 12% of the test set), and no step was taken.
    assert 0 <= evaluation["test_accuracy"] < 0.3 and np.isfinite(evaluation["test_loss"])
    assert f"test loss {evaluation['test_loss']:.4f} acc {evaluation['test_accuracy']:.4f}" in result.stdout
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
    assert not list((tmp_path / "checkpoints").glob("ckpt-*"))


def test_resume_before_the_first_checkpoint_starts_from_the_beginning(tmp_path):
    """A run stopped before its first save (a requeued job passes --resume all the same)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".tmp-ckpt-000047-1").mkdir()  # its interrupted first save
    result = hvdtrain(1, [*FAST, "--epochs", "1", "--log-dir", str(tmp_path), "--resume"], launcher="single")
    assert (f"--resume: no checkpoint in {tmp_path / 'checkpoints'} yet (the run stopped before its first save); "
            f"starting from the beginning") in result.stdout
    assert "epochs 1..1" in result.stdout
    assert [m["epoch"] for m in metrics(tmp_path)] == [1]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["ckpt-000094"]


def test_resume_without_checkpoints_after_epochs_were_logged_is_refused(tmp_path):
    """Checkpoints removed from a run that got further: starting over would overwrite its metrics."""
    (tmp_path / "checkpoints").mkdir()
    logged = "".join(json.dumps({"epoch": e, "test_accuracy": 0.5}) + "\n" for e in (1, 2))
    (tmp_path / "metrics.jsonl").write_text(logged)
    result = hvdtrain(1, [*FAST, "--epochs", "3", "--log-dir", str(tmp_path), "--resume"], launcher="single",
                      check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"hvdtrain: error: --resume: no checkpoint in {tmp_path / 'checkpoints'}, but "
                                     f"{tmp_path / 'metrics.jsonl'} records 2 epochs: that run's checkpoints were "
                                     f"removed; choose another --log-dir to start over")
    assert (tmp_path / "metrics.jsonl").read_text() == logged


def test_resume_from_a_mistyped_directory_creates_nothing(tmp_path):
    result = hvdtrain(2, [*FAST, "--resume", "--log-dir", str(tmp_path / "typo")], check=False)
    assert result.returncode != 0
    assert result.stderr.count(f"--resume: no checkpoint directory {tmp_path / 'typo' / 'checkpoints'}") == 1
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("norm", [[], ["--no-sync-bn"]])
def test_a_last_global_batch_smaller_than_the_world_size_trains(tmp_path, norm):
    """2 ranks x 8 over 33 examples: the last example joins the step before, so no rank gets an
    empty batch, which under oneDNN crashed the seed CNN's Conv2D (and would turn Keras' per-rank
    BatchNorm's moving statistics to NaN).

    And the test loss logged is that of the model checkpointed: recomputed in one process from the
    checkpoint, it matches. (With per-rank BatchNorm each rank's moving statistics differ; only rank
    0 saves, so without their averaging before the evaluation the checkpoint would hold rank 0's
    statistics while the logged loss mixed both ranks'.)"""
    rng = np.random.default_rng(0)
    data = tmp_path / "data.npz"
    np.savez(data, x_train=rng.integers(0, 256, (33, 28, 28), dtype=np.uint8), y_train=np.arange(33) % 10,
             x_test=rng.integers(0, 256, (7, 28, 28), dtype=np.uint8), y_test=np.arange(7) % 10)
    result = hvdtrain(2, ["--dataset", "npz", "--data-dir", str(data), "--batch-size", "8", "--epochs", "2",
                          "--no-progress", "--threads", "1", "--log-dir", str(tmp_path / "run"), *norm])
    assert "2 steps per epoch (last global batch 17: the 1 example(s) left over, fewer than the ranks, join it)" \
        in result.stdout
    logged = metrics(tmp_path / "run")
    assert [m["train_examples"] for m in logged] == [33, 33]
    assert all(np.isfinite(m["test_loss"]) for m in logged)

    from hvdtrain.model.zoo import build_model
    from hvdtrain.trainer import to_model_input

    model = build_model("cnn", (28, 28, 1), 10, sync_bn=not norm)
    latest = sorted((tmp_path / "run" / "checkpoints").glob("ckpt-*"))[-1]
    tf.train.Checkpoint(model=model).read(str(latest / "state")).expect_partial().assert_existing_objects_matched()
    with np.load(data) as d:
        images, labels = to_model_input(d["x_test"][..., None]), tf.constant(d["y_test"], tf.int32)
    losses = tf.keras.losses.sparse_categorical_crossentropy(labels, model(images, training=False), from_logits=True)
    assert float(tf.reduce_mean(losses)) == pytest.approx(logged[-1]["test_loss"], rel=1e-5)


def test_default_job_one_epoch_on_fashion_mnist(tmp_path):
    """README's first command for one epoch: horovodrun over MPI (its default here), the default
    model and data, every flag at its default, TensorFlow's environment as a user's (oneDNN as it
    sets it, no log level). The console, line by line: hvdtrain's lines from rank 0 and nothing
    else (no TensorFlow banner, from the ranks or from the launcher's check of the build), ending
    with the run folder and its files. mpirun tags each chunk of a rank's output: every line is
    written whole, so no tag lands after a line's text."""
    result = run_ranks(2, ["-m", "hvdtrain", "--epochs", "1", "--log-dir", str(tmp_path)], launcher="horovodrun-mpi",
                       timeout=600, env={"TF_ENABLE_ONEDNN_OPTS": None, "TF_CPP_MIN_LOG_LEVEL": None})
    expected = [
        r"hvdtrain: world size 2 \(2 local rank\(s\) x 1 host\(s\)\), device /CPU:0, 1 thread\(s\) per rank",
        r"data:  idx:/usr/share/datasets/fashion-mnist: 60,000 train / 10,000 test, 28x28x1, 10 classes; in memory",
        r"batch: local 128 x 2 rank\(s\) = global 256; 235 steps per epoch \(last global batch 96\)",
        r"lr:    base 0.05 x 2 = peak 0.1, linear warmup 1 epoch\(s\) \(235 steps\), then cosine; sgd \(momentum 0.9\)",
        r"model: cnn \(synchronized BatchNorm\), 422,315 parameters, fp32",
        r"task:  loss sparse_categorical_crossentropy; metrics accuracy \(exact: sums allreduced over ranks\)",
        rf"run:   {tmp_path} \(checkpoints {tmp_path}/checkpoints\), epochs 1..1",
        r"epoch   1/1  train loss 0\.\d{4} acc 0\.\d{4}  test loss 0\.\d{4} acc 0\.\d{4}  [\d,]+ img/s  [\d.]+ s  lr 0\.\d+",
        rf"hvdtrain: done: {tmp_path} holds model.keras, metrics.jsonl, curves.png, checkpoints/, config.yaml, "
        r"tensorboard/",
    ]
    lines = result.stdout.splitlines()
    assert len(lines) == len(expected), result.stdout
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(r"\[1,0\]<stdout>:" + pattern, line), (line, pattern)
    assert result.stderr == "", result.stderr[-3000:]
    last = metrics(tmp_path)[-1]
    assert last["world_size"] == 2 and last["train_examples"] == 60000
    assert last["test_accuracy"] >= 0.85


def test_mpirun_gives_matching_result(tmp_path, fashion_slice_job, fashion_slice_gloo_metrics):
    """Plain mpirun (ranks learn rank and size from OpenMPI) trains the default model on real data
    as horovodrun over Gloo does (a fifth of Fashion-MNIST, the run test_launch.py also compares against)."""
    result = hvdtrain(2, [*fashion_slice_job, "--log-dir", str(tmp_path)], launcher="mpirun", timeout=600)
    assert "warning" not in result.stderr  # started with -bind-to none: no word on CPU bindings
    mpi, gloo = metrics(tmp_path)[-1], fashion_slice_gloo_metrics
    assert mpi["world_size"] == 2 and mpi["train_examples"] == gloo["train_examples"] == 12000
    assert mpi["test_accuracy"] == pytest.approx(gloo["test_accuracy"], abs=0.002)
    assert mpi["train_loss"] == pytest.approx(gloo["train_loss"], rel=0.01)


def test_diverging_loss_stops_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    """The loss turns NaN at step 27 of epoch 3 (global step 121, 47 steps per epoch): every rank stops
    at step 30, the first exact global check after it; earlier checkpoints and metrics stay."""
    common = [*FAST, "--model", "tests.helpers.models:diverges_after_120_steps", "--log-dir", str(tmp_path),
              "--log-every", "5", "--epochs", "3"]
    result = hvdtrain(2, common, check=False)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("training diverged: the global training loss is nan at epoch 3, step 30; every rank "
                        "stopped there") == 1, output[-3000:]
    assert [m["epoch"] for m in metrics(tmp_path)] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt-000047", "ckpt-000094"]


@pytest.mark.parametrize("model, where, epochs, kept", [
    ("nan_update_at_step_57", "value(s) of the model's variables are NaN or infinite at the check after epoch 2, "
                              "step 10", [1], ["ckpt-000030", "ckpt-000040", "ckpt-000047"]),
    ("nan_update_at_step_47", "value(s) of the model's variables are NaN or infinite at the check after epoch 1, "
                              "step 47", [], ["ckpt-000020", "ckpt-000030", "ckpt-000040"]),
    ("nan_test_outputs_after_step_47", "the global test loss is nan after epoch 1", [],
     ["ckpt-000020", "ckpt-000030", "ckpt-000040"]),
], ids=["NaN weights before a mid-epoch checkpoint", "NaN weights at the end of an epoch", "a NaN test loss"])
def test_a_diverging_update_is_never_checkpointed(tmp_path, model, where, epochs, kept):
    """The last update before a checkpoint (every 10 steps, and at the end of each 47-step epoch)
    writes NaN weights from a finite loss, or finite weights give a NaN test loss: every rank stops
    before saving that state, and the checkpoints and metrics before it stay."""
    result = hvdtrain(2, [*FAST, "--model", f"tests.helpers.models:{model}", "--log-dir", str(tmp_path), "--epochs", "3",
                          "--checkpoint-every", "10"], check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("hvdtrain: error: training diverged: ") == 1 and where in output, output[-3000:]
    logged = metrics(tmp_path) if (tmp_path / "metrics.jsonl").exists() else []
    assert [m["epoch"] for m in logged] == epochs
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == kept


def test_a_variable_that_starts_infinite_is_not_a_divergence(tmp_path):
    """A -inf mask value held in a variable from the start: checkpoints are written as usual."""
    hvdtrain(1, [*FAST, "--model", "tests.helpers.models:mlp_with_an_infinite_variable", "--epochs", "1",
                 "--checkpoint-every", "20", "--log-dir", str(tmp_path)], launcher="single")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["ckpt-000060", "ckpt-000080",
                                                                            "ckpt-000094"]


def test_resume_mid_epoch_is_exact(tmp_path):
    """A crash right after a mid-epoch checkpoint (simulated by removing everything written after
    it), then --resume, ends with the weights and metrics of the uninterrupted run."""
    common = [*FAST, "--epochs", "2", "--checkpoint-every", "10", "--keep-checkpoints", "100", "--log-every", "5"]
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    hvdtrain(2, [*common, "--log-dir", str(whole)])
    shutil.copytree(whole, crashed)  # the same run, up to the crash
    for ckpt in (crashed / "checkpoints").iterdir():  # keep up to epoch 2, step 10 (global step 57)
        if int(ckpt.name.split("-")[1]) > 57:
            shutil.rmtree(ckpt)
    with open(crashed / "metrics.jsonl") as f:
        first_epoch = f.readline()
    (crashed / "metrics.jsonl").write_text(first_epoch)
    resumed = hvdtrain(2, [*common, "--log-dir", str(crashed), "--resume"])
    assert "resuming at step 11 of epoch 2" in resumed.stdout
    a, b = checkpoint_weights(whole / "checkpoints"), checkpoint_weights(crashed / "checkpoints")
    assert a.keys() == b.keys() and a
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
    for m_whole, m_resumed in zip(metrics(whole), metrics(crashed)):
        for key in ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert m_resumed[key] == pytest.approx(m_whole[key], rel=1e-6), key
    # TensorBoard shows each epoch once, the resumed run's, though the crashed run had logged epoch 2.
    board = tensorboard_scalars(crashed / "tensorboard" / "epochs")["epoch/test_accuracy"]
    assert board == [(m["epoch"], pytest.approx(m["test_accuracy"], rel=1e-6)) for m in metrics(crashed)]
    steps = [step for step, _ in tensorboard_scalars(crashed / "tensorboard" / "steps")["running/loss"]]
    assert steps == sorted(set(steps)) and steps[-1] == 92  # every 5th step of 47 per epoch, each once


def test_gradient_accumulation_with_a_short_last_batch_and_resume_is_exact(tmp_path):
    """--backward-passes-per-step 2 at local batch 66 (46 passes per epoch, the last of 60 examples),
    also crashed after a mid-epoch checkpoint and resumed, ends with the weights of one step per two
    passes: local batch 132 (23 steps per epoch, the last of 192 examples)."""
    common = [*FAST, "--epochs", "2", "--lr-schedule", "constant", "--warmup-epochs", "0"]
    accumulated, plain, crashed = tmp_path / "accumulated", tmp_path / "plain", tmp_path / "crashed"
    hvdtrain(2, [*common, "--batch-size", "66", "--backward-passes-per-step", "2", "--checkpoint-every", "10",
                 "--keep-checkpoints", "100", "--log-dir", str(accumulated)])
    hvdtrain(2, [*common, "--batch-size", "132", "--log-dir", str(plain)])
    a, b = checkpoint_weights(accumulated / "checkpoints"), checkpoint_weights(plain / "checkpoints")
    assert a.keys() == b.keys()
    assert_same_weights(a, b, prefix="model/")

    shutil.copytree(accumulated, crashed)
    for ckpt in (crashed / "checkpoints").iterdir():  # keep up to epoch 2, pass 10 (global pass 56)
        if int(ckpt.name.split("-")[1]) > 56:
            shutil.rmtree(ckpt)
    (crashed / "metrics.jsonl").write_text((accumulated / "metrics.jsonl").read_text().splitlines(True)[0])
    resumed = hvdtrain(2, [*common, "--batch-size", "66", "--backward-passes-per-step", "2", "--checkpoint-every",
                           "10", "--log-dir", str(crashed), "--resume"])
    assert "resuming at step 11 of epoch 2" in resumed.stdout
    c = checkpoint_weights(crashed / "checkpoints")
    assert c.keys() == a.keys()
    for k in a:
        np.testing.assert_allclose(c[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("message, lost", [
    ("Horovod has been shut down. This was caused by an exception on one of the ranks", True),
    ("[third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:37265: Connection reset by peer", True),
    ("Incompatible shapes: [4,3] vs. [4,2]", False),
])
def test_peer_loss_is_recognised_whichever_error_surfaces_first(message, lost):
    """A dead peer shows up as Horovod's shutdown or as Gloo's socket error, depending on timing."""
    from hvdtrain.errors import is_peer_loss

    assert is_peer_loss(RuntimeError(message)) is lost


def test_hvdtrain_errors_are_never_a_peer_loss():
    """This rank's own error stays its own even when it quotes an OS error that reads like one
    (a checkpoint on a network file system), so it is printed and not blamed on another rank."""
    from hvdtrain import HvdtrainError
    from hvdtrain.errors import is_peer_loss

    quoted = "cannot write checkpoint /nfs/run/ckpt-3: [Errno 104] Connection reset by peer"
    assert is_peer_loss(OSError(quoted))
    assert not is_peer_loss(HvdtrainError(quoted))
