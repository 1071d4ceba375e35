"""Opening the configured dataset on every rank: in memory, or streamed by tf.data."""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

from hvdtrain.config import CLASSES, DataConfig
from hvdtrain.data.in_memory import Dataset, load_dataset
from hvdtrain.data.labels import check_labels
from hvdtrain.data.stream import StreamingDataset

# Reading every file once (a first TFRecord index, a data function's count) may take long on a
# big dataset: the stall check waits up to this long for it.
LOADING_MAX_S = 6 * 3600.0


def open_dataset(ctx, data: DataConfig, seed: int, watchdog, labels: Optional[str] = CLASSES,
                 function: Optional[Tuple[Callable, str]] = None) -> Union[Dataset, StreamingDataset]:
    """The dataset ``data`` configures, on every rank (a collective).

    In-memory datasets are read whole by every rank. TFRecord shards are indexed by rank 0 (once,
    cached beside the data: :mod:`hvdtrain.data.tfrecord`) and every rank checks its files
    against that index; image folders are listed, and a data function called, by every rank.

    Args:
        ctx: this rank's :class:`~hvdtrain.runtime.dist.DistContext`.
        data: the data settings.
        seed: the run's seed.
        watchdog: paused while the data is read (it can take long the first time).
        labels: in-memory datasets: their labels as the loss takes them, ``"classes"``,
            ``"targets"`` or None (:func:`hvdtrain.data.in_memory.validate`). Streamed datasets
            hold class indices.
        function: with ``data.dataset == "function"``, the data function itself and what messages
            call it (``hvdtrain.fit(data=...)``), used instead of importing ``data.function``.

    Raises:
        FoundHere / PeerFailure: holding the :class:`HvdtrainError` of the rank that failed, on
            every rank (:meth:`DistContext.guarded`).
    """
    watchdog.pause("loading data", LOADING_MAX_S)
    if data.dataset == "tfrecord":
        from hvdtrain.data import tfrecord

        keys = (data.tfrecord_image_key, data.tfrecord_label_key)

        def index():
            train, test = tfrecord.find_files(data.data_dir)
            return tfrecord.load_index(data.data_dir, train + test, *keys)

        chief_index, scanned = ctx.guarded("indexing the TFRecord files", lambda: index() if ctx.is_chief else (None, False))
        chief_index = ctx.broadcast_object(chief_index, name="hvdtrain.tfrecord_index")
        opened = ctx.guarded("opening the TFRecord files", lambda: tfrecord.open_tfrecords(
            data.data_dir, chief_index, *keys, data.num_classes, data.image_size, data.augment, data.shuffle_buffer,
            seed, check_labels))
        if scanned:  # cached only once every rank found the data good: bad data leaves no file behind
            tfrecord.save_index(data.data_dir, chief_index, *keys)
    elif data.dataset == "folder":
        from hvdtrain.data.folder import open_folder

        opened = ctx.guarded("opening the image folder",
                             lambda: open_folder(data.data_dir, data.image_size, data.augment, seed))
    elif data.dataset == "function":
        from hvdtrain.data.function import open_function

        fn, where = function or (data.function, None)
        opened = ctx.guarded("opening --data", lambda: open_function(fn, ctx.rank, ctx.size, seed, data.num_classes,
                                                                      check_labels, where))
    else:
        opened = ctx.guarded("loading data", lambda: load_dataset(data.dataset, data.data_dir, seed, labels))
    watchdog.beat("loaded data")
    return opened
