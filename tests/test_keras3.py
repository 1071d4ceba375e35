"""Keras 3 models across ranks (``import keras``, TensorFlow backend): N ranks == one process on the
global batch, under each optimizer, clip-norm and gradient accumulation; fp16's skipped step agreed
by every rank; bf16; exact resume; the trained model's ``.keras`` file; a real model (MobileNetV2).

The Keras 2 twins of these tests are in test_trainer.py, test_precision.py and test_cli.py; the
Keras 3 user's script (callbacks, their optimizer, tf.data) is in test_users_keras.py.
"""
import json
import shutil

import numpy as np
import pytest

from tests.helpers.oracle import assert_same_weights
from tests.helpers.ranks import REPO, rank_env, run_ranks
from tests.helpers.runs import hvdtrain, metrics
from tests.helpers.kerases import KERAS_3
from tests.helpers.runs import train_steps, weights

pytestmark = pytest.mark.skipif(not KERAS_3, reason="needs Keras 3 (TensorFlow >= 2.16)")

CONVERTED = ["tests.helpers.models:keras3_cnn_bn", "--convert-sync-bn"]  # Keras 3's BatchNormalization, converted
OPTIMIZERS = {
    "sgd": [],
    "adam": ["--optimizer", "adam", "--lr", "0.01"],
    "adamw": ["--optimizer", "adamw", "--weight-decay", "0.05", "--lr", "0.01"],
    "users-adam": ["--users-optimizer", "--lr", "0.01"],
    "clip-norm": ["--clip-norm", "0.05"],
    "users-adam-clip-norm": ["--users-optimizer", "--lr", "0.01", "--clip-norm", "0.05"],
    "backward-passes-2": ["--backward-passes-per-step", "2"],
}


ONEDNN = {"onednn-default": None, "onednn-off": "0"}  # None: as TensorFlow sets it on this host (on, on AVX-512)


def _job(tmp_path, tag, np_, sizes, steps, model, extra, env=None):
    model_name, *flags = model
    return weights(train_steps(tmp_path, tag, np_, model_name, sizes, str(steps), *flags, *extra,
                               launcher="gloo" if np_ > 1 else "single", env=env))


def _assert_converted_cnn_equals_one_process(tmp_path, extra, env=None):
    dtype = np.float64 if "fp64" in extra else np.float32
    rank0 = _job(tmp_path, "ranks", 2, "5,27", 10, CONVERTED, extra, env)
    rank1 = weights(str(tmp_path / "ranks"), 1)
    oracle = _job(tmp_path, "oracle", 1, "32", 10, CONVERTED, extra, env)
    for w in (rank0, rank1):
        assert_same_weights(w, oracle, dtype=dtype)
    moved = [k for k in rank0 if k.startswith("final/")
             and not np.array_equal(rank0[k], rank0["initial/" + k[len("final/"):]])]
    assert len(moved) >= 10, "the model did not train"
    assert int(rank0["iterations"]) == int(oracle["iterations"]) == 10


@pytest.mark.parametrize("variant", list(OPTIMIZERS))
def test_converted_cnn_at_two_ranks_equals_one_process_on_the_global_batch(tmp_path, variant):
    """10 steps of a Keras 3 CNN whose Keras BatchNormalization layers were converted, at local
    batches 5 + 27 against one process at 32 (the same global batches), in float64 to 1e-12 per
    tensor: every rank ends with the one process's weights and moving statistics. With
    accumulation, 2 ranks x 2 passes against one process x 2 passes (BatchNorm normalizes each
    pass's batch)."""
    _assert_converted_cnn_equals_one_process(tmp_path, [*OPTIMIZERS[variant], "--precision", "fp64"])


@pytest.mark.parametrize("onednn", list(ONEDNN))
@pytest.mark.parametrize("variant", ["sgd", "backward-passes-2"])
def test_converted_cnn_in_float32_on_the_kernels_users_get(tmp_path, variant, onednn):
    """The same in float32, with oneDNN's custom kernels as TensorFlow sets them on this host and
    pinned off, to 1e-5 per tensor (float32 rounding, as tests/helpers/oracle.py derives it)."""
    _assert_converted_cnn_equals_one_process(tmp_path, OPTIMIZERS[variant], {"TF_ENABLE_ONEDNN_OPTS": ONEDNN[onednn]})


def test_ranks_start_from_rank_0s_weights_and_stay_alike(tmp_path):
    """Keras 3 variables broadcast from rank 0 (ranks initialised with different seeds), then
    identical after every step: Horovod's allreduce ran inside Keras 3's update (a wrapper that
    averaged nothing would leave them apart: the ranks see different examples)."""
    r0 = _job(tmp_path, "ranks", 2, "16,16", 5, ["tests.helpers.models:keras3_mlp"], [])
    r1 = weights(str(tmp_path / "ranks"), 1)
    assert any(not np.array_equal(r0[k], r1[k]) for k in r0 if k.startswith("before_broadcast/"))
    for k in r0:
        if not k.startswith("before_broadcast/"):
            np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Keras 3 twin of test_precision's: rank 1's batch at step 3 overflows float16; every rank
    skips that step, keeps its weights and moving statistics, and halves its loss scale once."""
    out = train_steps(tmp_path, "ranks", 2, "tests.helpers.models:keras3_cnn_sync_bn", "16,16", "6", "--precision", "fp16",
                      "--overflow", "1:3")
    ranks = [weights(out, rank) for rank in (0, 1)]
    for w in ranks:
        assert int(w["skipped_steps"]) == 1 and float(w["loss_scale"]) == 2.0 ** 14
        assert int(w["iterations"]) == 5
        for key in (k for k in w if k.startswith("before_overflow/")):
            np.testing.assert_array_equal(w[key.replace("before_overflow/", "after_overflow/")], w[key], err_msg=key)
    for key in (k for k in ranks[0] if k.startswith(("after_overflow/", "final/"))):
        np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
    assert all(np.all(np.isfinite(v)) for k, v in ranks[0].items() if k.startswith("final/"))


def test_bf16_step_matches_one_process_on_the_global_batch(tmp_path):
    """Keras 3 twin of test_precision's bf16 test, with its tolerance: twice the change of feeding
    one process its batch in reverse order, plus one bfloat16 rounding (2^-8) of the update (each
    rank's gradient is rounded once more before the float32 allreduce), plus float32's 1e-5."""
    model, extra = ["tests.helpers.models:keras3_cnn_sync_bn"], ["--precision", "bf16"]
    ranks = _job(tmp_path, "ranks", 2, "5,27", 1, model, extra)
    oracle = _job(tmp_path, "oracle", 1, "32", 1, model, extra)
    reordered = _job(tmp_path, "reversed", 1, "32", 1, model, [*extra, "--reverse"])
    for key in (k for k in oracle if k.startswith("final/")):
        update = np.linalg.norm(oracle[key] - oracle[key.replace("final/", "initial/")])
        reorder = np.linalg.norm(reordered[key] - oracle[key])
        tolerance = 2 * reorder + 2.0 ** -8 * update + 1e-5 * np.linalg.norm(oracle[key])
        assert np.linalg.norm(ranks[key] - oracle[key]) <= tolerance, key
    assert any(np.linalg.norm(oracle[k] - oracle[k.replace("final/", "initial/")]) > 0 for k in oracle
               if k.startswith("final/"))


def checkpoint_tensors(checkpoint_dir) -> dict:
    """{key: array} of every tensor in the newest checkpoint of a run."""
    import tensorflow as tf

    latest = sorted(p for p in checkpoint_dir.iterdir() if p.name.startswith("ckpt-"))[-1]
    reader = tf.train.load_checkpoint(str(latest / "state"))
    return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"}


FAST3 = ["--dataset", "synthetic", "--model", "tests.helpers.models:keras3_cnn_bn", "--convert-sync-bn", "--batch-size", "64",
         "--no-progress", "--threads", "1"]


def test_resume_mid_epoch_equals_the_uninterrupted_run(tmp_path):
    """A crash right after a mid-epoch checkpoint (everything written after it removed), then
    --resume: the weights and metrics of the uninterrupted run (Keras 3 model and optimizer state
    in hvdtrain's checkpoints)."""
    common = [*FAST3, "--epochs", "2", "--checkpoint-every", "10", "--keep-checkpoints", "100", "--optimizer", "adam",
              "--lr", "0.002"]
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    hvdtrain(2, [*common, "--log-dir", str(whole)])
    shutil.copytree(whole, crashed)
    for ckpt in (crashed / "checkpoints").iterdir():  # keep up to epoch 2, step 10 (global step 57)
        if int(ckpt.name.split("-")[1]) > 57:
            shutil.rmtree(ckpt)
    with open(crashed / "metrics.jsonl") as f:
        first_epoch = f.readline()
    (crashed / "metrics.jsonl").write_text(first_epoch)
    resumed = hvdtrain(2, [*common, "--log-dir", str(crashed), "--resume"])
    assert "resuming at step 11 of epoch 2" in resumed.stdout
    # Keras 3's trainable variables sit in the checkpoint under the optimizer's path (it tracks them
    # too, and each variable is saved once): compare every tensor.
    a, b = checkpoint_tensors(whole / "checkpoints"), checkpoint_tensors(crashed / "checkpoints")
    assert a.keys() == b.keys() and len(a) >= 30
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-6, atol=1e-7, err_msg=k)
    for m_whole, m_resumed in zip(metrics(whole), metrics(crashed)):
        for key in ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy"):
            assert m_resumed[key] == pytest.approx(m_whole[key], rel=1e-6), key


def test_the_trained_model_file_reloads_to_the_same_accuracy(tmp_path):
    """model.keras of a Keras 3 run (the built-in CNN, Keras 3 by default here) reloads with
    hvdtrain.load_model as a Keras 3 model with hvdtrain's Keras 3 layers, and scores the run's
    own test accuracy on the test set."""
    hvdtrain(2, ["--dataset", "synthetic", "--epochs", "1", "--batch-size", "64", "--no-progress", "--threads", "1",
                 "--log-dir", str(tmp_path)])
    code = f"""
import json, numpy as np, hvdtrain
from hvdtrain.data.in_memory import make_synthetic
from hvdtrain.config import DataConfig
model = hvdtrain.load_model({str(tmp_path / "model.keras")!r})
data = __import__("hvdtrain.data.in_memory", fromlist=["x"]).load_dataset("synthetic", "", 0, "classes")
logits = np.asarray(model(data.x_test.astype(np.float32) / 255.0, training=False))
print(json.dumps({{"accuracy": float(np.mean(logits.argmax(1) == data.y_test)), "model": type(model).__module__,
                  "layers": sorted({{type(l).__module__ for l in model.layers if "Sync" in type(l).__name__}})}}))
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["model"].startswith("keras.") and loaded["layers"] == ["hvdtrain.keras3"]
    assert loaded["accuracy"] == pytest.approx(metrics(tmp_path)[-1]["test_accuracy"], abs=1e-9)


def test_keras_3_mobilenet_v2_converted_trains_at_two_ranks(tmp_path, cifar_like):
    """Keras 3's MobileNetV2 (alpha 0.35, 32x32x3, no weights), its 52 BatchNormalization layers
    converted, trains an epoch at np=2 from the command line (its loss falls); hvdtrain verify on
    it passes (tests/tools/test_verify.py)."""
    out = hvdtrain(2, ["--model", "tests.helpers.models:keras3_mobilenet_v2", "--convert-sync-bn", *cifar_like, "--epochs", "2",
                       "--batch-size", "32", "--optimizer", "adam", "--lr", "0.001", "--no-progress", "--threads", "1",
                       "--log-dir", str(tmp_path)], timeout=600)
    assert "Keras BatchNormalization layer(s)" not in out.stderr
    history = metrics(tmp_path)
    assert len(history) == 2 and history[1]["train_loss"] < history[0]["train_loss"]
    assert (tmp_path / "model.keras").exists()


def test_xla_matches_one_process_on_the_global_batch(tmp_path):
    """--xla with a Keras 3 model: the compiled forward and backward pass, the allreduce outside it,
    at np=2 (5 + 27) against one process at 32 without XLA, to 1e-5."""
    ranks = _job(tmp_path, "ranks", 2, "5,27", 10, ["tests.helpers.models:keras3_mlp"], ["--xla"])
    oracle = _job(tmp_path, "oracle", 1, "32", 10, ["tests.helpers.models:keras3_mlp"], [])
    assert int(ranks["compiled_by_xla"]) == 1
    assert_same_weights(ranks, oracle)


def test_fp16_allreduce_changes_the_update_by_half_precision_rounding_only(tmp_path):
    """--fp16-allreduce with a Keras 3 model: the first update differs from the float32 one by
    float16 rounding of the gradients (relative 2^-11 per element: 1e-3 in norm), and not by nothing."""
    fp16 = _job(tmp_path, "fp16", 2, "16,16", 1, ["tests.helpers.models:keras3_mlp"], ["--fp16-allreduce"])
    fp32 = _job(tmp_path, "fp32", 2, "16,16", 1, ["tests.helpers.models:keras3_mlp"], [])
    changed = False
    for key in (k for k in fp32 if k.startswith("final/")):
        initial = fp32["initial/" + key[len("final/"):]]
        update16, update32 = fp16[key] - initial, fp32[key] - initial
        assert np.linalg.norm(update16 - update32) <= 1e-3 * np.linalg.norm(update32), key
        changed |= not np.array_equal(update16, update32)
    assert changed, "compression had no effect"


def test_horovods_distributed_optimizer_averages_keras_3_gradients(tmp_path):
    """hvd.DistributedOptimizer on a Keras 3 Adam, as Horovod's own users call it (patch 0006): in a
    custom loop's apply_gradients, in Keras 3's model.fit, with backward_passes_per_step 2, ranks
    fed different data end with equal weights, which an optimizer that averaged nothing would not;
    a variable registered as local keeps each rank's own gradient."""
    run_ranks(2, ["-m", "tests.workers.keras3_horovod", str(tmp_path)], timeout=300)
    r0, r1 = (np.load(tmp_path / f"rank{r}.npz") for r in (0, 1))
    for name in ("apply_gradients", "backward_passes_2", "fit"):
        keys = [k for k in r0.files if k.startswith(f"{name}/") and not k.endswith("iterations")]
        assert keys and all(np.array_equal(r0[k], r1[k]) for k in keys), name
    assert int(r0["apply_gradients/iterations"]) == 4 and int(r0["backward_passes_2/iterations"]) == 4
    kernels, bias = ["local_bias/0", "local_bias/1", "local_bias/2"], "local_bias/3"
    assert all(np.array_equal(r0[k], r1[k]) for k in kernels) and not np.array_equal(r0[bias], r1[bias])


def test_a_users_float64_keras_3_script_at_two_ranks_equals_one_process(tmp_path):
    """The user's keras.config.set_floatx("float64") holds through hvdtrain.fit (its model is
    float64, and so its gradients and allreduce): a converted Keras 3 CNN with the user's SGD with
    momentum, np=2 x 32 against one process x 64 over 32 steps, to the float64 tolerance."""
    run_ranks(2, ["-m", "tests.workers.floatx_fit", "float64", "32", str(tmp_path / "np2")], timeout=300)
    done = run_ranks(1, ["-m", "tests.workers.floatx_fit", "float64", "64", str(tmp_path / "np1")],
                     launcher="single", timeout=300)
    assert "parameters, fp64" in done.stdout
    ranks, alone = (dict(np.load(tmp_path / run / "weights.npz")) for run in ("np2", "np1"))
    assert_same_weights(ranks, alone, dtype=np.float64)
