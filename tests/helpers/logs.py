"""Reading back what a run logged, as its users' tools read it."""


def tensorboard_scalars(run_dir) -> dict:
    """``{tag: [(step, value)]}`` of one TensorBoard run directory, as TensorBoard's Python event
    loader (``tensorboard --load_fast=false``) serves it: restart markers (``SessionLog`` START)
    applied across the run's event files, scalars stored as tensors."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in accumulator.Tensors(tag)]
            for tag in accumulator.Tags()["tensors"]}
