"""Reading a file with torch's weights-only unpickler and the run-checkpoint allow-list, and
saying why a refused file was refused."""
import contextlib
import os
import os.path as osp
import pickle
import zipfile

import torch

from .restoring import (UnsafeCheckpointError, _restoring, _run_checkpoint_globals,
                        unsafe_numpy_data)


def load_weights_only(path, map_location='cpu'):
    """``torch.load(weights_only=True)`` with an error that says why a file is refused."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(
            f'{path} pickles objects beyond tensors and plain containers, so it was not loaded '
            '(weight files are read with weights_only=True: unpickling them in full could run '
            f'code they carry): {_refusal_reason(path, err)}') from err


def _rewound(source):
    if not isinstance(source, (str, os.PathLike)):
        source.seek(0)
    return source


def _is_torch_file(source):
    """A zip archive (torch.save) or a pickle of protocol 2 or later (legacy torch.save)."""
    with contextlib.ExitStack() as stack:
        f = (stack.enter_context(open(source, 'rb')) if isinstance(source, (str, os.PathLike))
             else _rewound(source))
        if zipfile.is_zipfile(f):
            return True
        f.seek(0)
        return f.read(1) == pickle.PROTO


def _refusal_reason(source, err):
    """The globals a checkpoint names beyond the allow-list in force, or else the weights-only
    unpickler's own reason (without its advice to allow-list more)."""
    refused = []
    if zipfile.is_zipfile(_rewound(source)):  # torch reads the globals of zip checkpoints only
        refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(_rewound(source)))
    if refused:
        return (f'it pickles {", ".join(map(repr, refused))}, which the loader does not allow '
                f'(tensors, plain containers, numpy data, mmengine run metadata)')
    message = str(err).split('WeightsUnpickler error: ', 1)[-1].strip()
    message = message.splitlines()[0].split(' Please use `torch.serialization', 1)[0]
    return f'torch\'s weights-only unpickler refused it ({message})'


def _load_safely(source, name, map_location):
    """Unpickle ``source`` (a path or a binary file object) with the run-checkpoint allow-list;
    ``name`` says which file in messages."""
    # The context adds to torch's process-wide allow-list (threads loading meanwhile see it
    # too; the stand-ins refuse to work outside this function) and removes on exit what it
    # added, so what a caller had allowed stays allowed.
    present = set(torch.serialization.get_safe_globals())
    missing = [entry for entry in _run_checkpoint_globals() if entry not in present]
    advice = ('Nothing it carries was run; if the file comes from a source you trust, save its '
              'tensors as a plain state dict (torch.load(weights_only=False) outside linvit_mm) '
              'and load that')
    with torch.serialization.safe_globals(missing), _restoring() as restoration:
        try:
            # weights_only given explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD only changes
            # torch's default
            checkpoint = torch.load(_rewound(source), map_location=map_location,
                                    weights_only=True)
        except pickle.UnpicklingError as err:
            if restoration.refusal:
                raise UnsafeCheckpointError(
                    f'{name}: refusing to unpickle it: {restoration.refusal}. {advice}') from err
            if not _is_torch_file(source):
                raise pickle.UnpicklingError(
                    f'{name} is not a torch.save file (neither a zip archive nor a pickle)'
                ) from err
            raise UnsafeCheckpointError(
                f'{name}: refusing to unpickle it: {_refusal_reason(source, err)}. {advice}'
            ) from err
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as err:
            # an allowed constructor (numpy's, say) rejected the state the file gives it
            raise UnsafeCheckpointError(
                f'{name}: refusing to unpickle it: an object it pickles cannot be rebuilt from '
                f'the state it gives ({type(err).__name__}: {err}). {advice}') from err
        unfinished = restoration.unfinished()
        if unfinished:
            raise UnsafeCheckpointError(
                f'{name}: refusing to unpickle it: it pickles {", ".join(unfinished)} without '
                f'the state a genuine one has. {advice}')
    forged = unsafe_numpy_data(checkpoint)
    if forged:
        raise UnsafeCheckpointError(
            f'{name}: refusing it: {forged}. Run checkpoints hold numpy data of plain numeric '
            f'or bool types only. {advice}')
    return checkpoint


def load_checkpoint_file(path, map_location=None):
    """Load weights or an mmengine run checkpoint; refuse anything that would run code."""
    path = osp.expanduser(str(path))
    if not osp.isfile(path):
        raise FileNotFoundError(f'{path} can not be found.')
    return _load_safely(path, path, map_location)
