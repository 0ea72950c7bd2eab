"""Checkpoint loading under torch >= 2.6 without ever unpickling code.

torch 2.6 made ``torch.load`` weights-only by default. Two kinds of files reach
mmengine's checkpoint loader in this project:

* weight files from outside (DeiT releases, timm or self-supervised state dicts,
  ``init_cfg=dict(type='Pretrained', ...)``): plain tensors and containers;
* mmengine run checkpoints (``--resume``, ``load_from``, ``tools/test.py CKPT``,
  the classification-stage checkpoint that initialises a detector). Besides
  tensors they pickle mmengine's ``HistoryBuffer``, numpy arrays and scalars, and
  the buffer's statistics table as ``getattr(HistoryBuffer, 'mean')``; DeiT, DINO
  and MAE training checkpoints carry their ``args`` as an ``argparse.Namespace``.

Both are read by torch's own weights-only unpickler (``weights_only=True`` passed
explicitly, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` does not override), with these
data types added to its allow-list for the duration of the load
(``torch.serialization.safe_globals``). That unpickler calls only allow-listed
functions and restores state (the pickle ``BUILD`` step) only on instances of
allow-listed types, never on a class, function or module.

It restores an allowed instance through the class's own ``__setstate__``, and
``HistoryBuffer.__setstate__`` writes the pickled statistics table into the
*class-level* ``_statistics_methods``: a file could make ``statistics('mean')`` of
every buffer in the process compute something else. So the names
``mmengine.logging.history_buffer.HistoryBuffer`` and ``argparse.Namespace`` resolve
to stand-ins (:class:`_Restorer`) that accept exactly the instance data a genuine
object pickles, check it, and only then become the real class; the statistics table
a genuine buffer pickles (mmengine's four default methods) is checked and dropped,
never written anywhere.

The one function of our own is ``getattr``: allow-listing ``builtins.getattr`` would
reach anything, so the name maps to one that returns only the four default statistics
methods of ``HistoryBuffer``. Anything else (a pickle naming any other global,
building on a class, or state a genuine object does not have) is refused with
``UnsafeCheckpointError`` that names it; nothing it carries runs.

``install_checkpoint_policy`` routes every scheme of mmengine's ``CheckpointLoader``
here: local paths, ``http(s)://`` (downloaded to torch hub's cache as mmengine does,
then read as a local file), ``open-mmlab://`` / ``openmmlab://``, ``torchvision://`` /
``modelzoo://``, ``mmcls://``, ``pavi://`` and ``s3://`` / ``petrel://``; a scheme
registered by another package before linvit_mm is imported is refused by name, since
its loader would call plain ``torch.load``.
"""
from .loading import load_checkpoint_file, load_weights_only
from .restoring import UnsafeCheckpointError
from .schemes import install_checkpoint_policy

__all__ = ['UnsafeCheckpointError', 'install_checkpoint_policy', 'load_checkpoint_file',
           'load_weights_only']
