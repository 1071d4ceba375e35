"""Reading back what a run logged, as its users' tools read it."""


def tensorboard_scalars(run_dir) -> dict:
    """``{tag: [(step, value)]}`` of one TensorBoard run directory, as TensorBoard loads it: its own
    event accumulator, which applies restart markers (``SessionLog`` START) across event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}
