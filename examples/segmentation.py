"""Segmentation with synchronized BatchNorm: a U-Net labels every pixel of Fashion-MNIST images.

    horovodrun -np 2 python examples/segmentation.py            # add --no-sync-bn to compare

Each pixel brighter than 32 is the garment, labelled with the image's class + 1; the rest is
background, 0 (hvdtrain.tools.make_segmentation). With 2 images per rank, per-rank BatchNorm
normalizes with the statistics of 2 images; synchronized BatchNorm with those of the global batch.
Mean IoU is exact over all ranks: their confusion matrices are summed by one allreduce.
"""
import argparse

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir
from hvdtrain.tools.make_segmentation import label_maps

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=10000, help="training images (of 60,000)")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--no-sync-bn", action="store_true")
p.add_argument("--log-dir", default=None)
a = p.parse_args()

# Every rank loads the same arrays; hvdtrain gives each its shard of every global batch.
fashion = load_idx_dir("/usr/share/datasets/fashion-mnist")
x_train, x_test = fashion.x_train[:a.train], fashion.x_test[:2000]
data = (x_train, label_maps(x_train, fashion.y_train[:a.train], 32),
        x_test, label_maps(x_test, fashion.y_test[:2000], 32))

result = hvdtrain.fit(
    "unet", data,
    loss="sparse_categorical_crossentropy",  # per pixel, averaged per image
    metrics=["accuracy", "mean_iou"],
    epochs=a.epochs, batch_size=2,  # a small local batch: where synchronized BatchNorm matters
    model={"sync_bn": not a.no_sync_bn},
    optim={"base_lr": 0.02, "warmup_epochs": 0.5},
    log={"dir": a.log_dir, "progress": False},
)
if result.is_chief:  # every rank has the same global metrics: rank 0 says
    print(f"held-out mean IoU {result.metrics['test_mean_iou']:.4f}")
