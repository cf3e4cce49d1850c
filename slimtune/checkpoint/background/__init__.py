"""Zero-stall checkpoints (``checkpoint.async``): at a save point the training loop only snapshots what
changes (adapters, optimizer, scheduler, loss scaler, RNG, data position: ``train_state``, the recipe
state and the small documents) and hands it to a writer, which writes the whole checkpoint through the
one writer (``CheckpointManager.save`` -> ``write_checkpoint``) while training goes on.

The parts, one idea each:

- ``protocol.py``: the messages (``Request``, ``Done``, ``Failed``, ...), ``WriterKind`` and the one
  ``Writer`` protocol;
- ``saver.py``: ``BackgroundSaver``, the policy (one save in flight, the nice step-down, agreement
  between ranks) and the choice of the writer, once per run (``choose_kind``);
- ``forked.py``: ``WriterKind.FORK`` (a model in host memory, one process, Linux): a writer forked at
  each save point, the trainer's memory as the snapshot, copy-on-write;
- ``process.py``: ``WriterKind.PROCESS`` (a model on a GPU, or under torchrun): a process per rank
  started with the run that rebuilt the frozen model from the base files (``writer_main``, a free
  function), the writers of a job in their own gloo group;
- ``snapshot.py``: the snapshot's tensors to the host and back, and the one save of a ``Request``;
- ``child.py``: a writer process from both sides, and how it ends with its trainer (SIGTERM; then
  ``reaper.py``, a small process that kills it ``reaper.GRACE_S`` after the trainer's death).

Either way an asynchronous checkpoint is the synchronous one, byte for byte (tested); the figures
behind the choice of writer are in docs/benchmarks.md. ``SLIMTUNE_ASYNC_WRITER=process`` asks for the
process writer where a forked one would do (``fork``, the default, where it can). A failure in a writer
(a full disk, a read-only file system, a killed writer) is raised as one ``SlimtuneError`` line at the
trainers' next step, after the writers' temporary directory is gone; a temporary directory left anyway
is reclaimed by its lock (``atomic.py``). Writers are named ``slimtune-ckpt`` (ps, top).

Example::

    saver = BackgroundSaver(WriterSpec(model_dir, lora, seed=0, dtype=torch.bfloat16), manager, model=model)
    if saver.available(step):
        stall_s = saver.submit(step, state, options, train_state)   # returns once the snapshot is sent
    saver.annotate(record)        # every step: in-flight flag, a finished save's figures; raises a failure
    saver.close()                 # waits for the last save
"""

from slimtune.checkpoint.background.protocol import Writer, WriterGroup, WriterKind, WriterSetup, WriterSpec
from slimtune.checkpoint.background.saver import MECHANISM_ENV, BackgroundSaver, choose_kind, custom_writer

__all__ = [
    "MECHANISM_ENV",
    "BackgroundSaver",
    "Writer",
    "WriterGroup",
    "WriterKind",
    "WriterSetup",
    "WriterSpec",
    "choose_kind",
    "custom_writer",
]
