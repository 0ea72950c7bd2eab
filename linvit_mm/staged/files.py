"""Reading and writing the staged recipe's checkpoint files, with errors that name the file.

torch reports a truncated or damaged file with its own error (``OSError: [Errno 22] Invalid
argument``, ``PytorchStreamReader failed reading zip archive``) and no path, and a tool that
writes after a long merge learns only then that its output path cannot be created. These
helpers turn both into a ``ValueError`` that names the file, raised before any work.
"""
import os
import os.path as osp
import pickle
import zipfile

__all__ = ['check_output_path', 'read_checkpoint']


def read_checkpoint(path, map_location='cpu', what='checkpoint'):
    """Load ``path`` with linvit_mm's safe loader; any failure is a ``ValueError`` (a
    ``FileNotFoundError`` for a missing file) that names the file."""
    from linvit_mm.utils.checkpoint import load_checkpoint_file
    path = str(path)
    if not osp.isfile(osp.expanduser(path)):
        raise FileNotFoundError(f'{what} {path} can not be found')
    try:
        return load_checkpoint_file(path, map_location=map_location)
    except pickle.UnpicklingError as err:
        # the safe loader's refusal already names the file and the reason
        raise ValueError(str(err)) from err
    except (OSError, RuntimeError, EOFError, KeyError, IndexError, zipfile.BadZipFile) as err:
        raise ValueError(f'{what} {path} cannot be read, it is truncated or damaged '
                         f'({type(err).__name__}: {_first_line(err)}); write it again or use '
                         f'another copy') from err


def _first_line(err):
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else repr(err)


def check_output_path(out, inputs=()):
    """Refuse, before any work, an output path that cannot be written: a directory, one
    under a regular file, one in a directory without write permission, or one of
    ``inputs``. Missing directories are fine (the writer creates them)."""
    out = str(out)
    if osp.isdir(out):
        raise ValueError(f'OUT {out} is a directory; give a file path')
    for source in inputs:
        if osp.exists(out) and osp.exists(str(source)) and osp.samefile(out, str(source)):
            raise ValueError(f'OUT {out} is one of the inputs ({source}); give another path')
    parent = osp.dirname(osp.abspath(out))
    existing = parent
    while not osp.exists(existing):
        existing = osp.dirname(existing)
    if not osp.isdir(existing):
        raise ValueError(f'OUT {out} cannot be created: {existing} is a file, not a directory')
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f'OUT {out} cannot be created: no write permission in {existing}')
