"""A local file backend whose writes replace the target whole, or not at all."""
import os
import os.path as osp
import secrets

import mmengine
from mmengine.fileio import LocalBackend, register_backend


class AtomicLocalBackend(LocalBackend):
    """``LocalBackend`` that writes to a temporary file beside the target, then renames it.

    mmengine's ``LocalBackend.put`` opens the checkpoint in place, so a run killed
    during a save (out of time, out of memory, a pre-empted node) leaves a truncated
    ``iter_N.pth`` that ``--resume`` then fails on, or an old checkpoint half
    overwritten. Here the bytes go to ``.NAME.<pid>.<random>.tmp`` in the same
    directory, are flushed to disk, and ``os.replace`` (atomic within a file system)
    puts them in place: every ``*.pth`` present is complete. A save killed midway
    leaves at most that hidden ``.tmp`` file, which nothing loads and which can be
    deleted.

    Registered as ``'atomic_local'``: checkpoints of a run use it with
    ``default_hooks = dict(checkpoint=dict(backend_args=dict(backend='atomic_local')))``
    (``tools/train.py`` sets this when the config sets no backend).
    """

    def put(self, obj, filepath):
        self._write_atomically(obj, filepath, 'b')

    def put_text(self, obj, filepath, encoding='utf-8'):
        self._write_atomically(obj, filepath, 't', encoding)

    @staticmethod
    def _write_atomically(obj, filepath, mode, encoding=None):
        filepath = str(filepath)
        directory, name = osp.split(osp.abspath(filepath))
        mmengine.mkdir_or_exist(directory)
        temp_path = osp.join(directory, f'.{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp')
        try:
            # 'x': a fresh file with the permissions a plain open would give (umask).
            with open(temp_path, 'x' + mode, encoding=encoding) as f:
                f.write(obj)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp_path, filepath)
        except BaseException:
            if osp.exists(temp_path):
                os.remove(temp_path)
            raise
        _sync_directory(directory)


def _sync_directory(directory):
    """Make the rename itself durable (POSIX); where directories cannot be opened, skip."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


register_backend('atomic_local', AtomicLocalBackend)
