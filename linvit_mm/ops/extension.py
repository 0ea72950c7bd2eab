"""linvit_mm's C++ CPU kernels, compiled on first use with ``torch.utils.cpp_extension``.

ViT^3's inner step is a dozen small tensor operations per block, MHLA's attention about
twenty-five; at 196 tokens their set-up costs (oneDNN primitives for tiny depthwise
convolutions, one memory pass per elementwise operation, one autograd node each) outweigh
the arithmetic. ``csrc/`` fuses them. The build needs a C++ compiler and ninja (both part of
the environment ``tools/setup_env.sh`` makes), takes about half a minute once, and is cached
by torch per user
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``). torch keys that cache by
the extension's name only, so the name carries a digest of the sources
(:func:`extension_name`): two checkouts with different kernels build and load their own,
checkouts with the same kernels share one build.

Where the kernels cannot be used (no compiler, tensors on a GPU, fp16/bf16, or
``LINVIT_MM_CPU_KERNELS=0`` in the environment) every caller runs the same computation with
PyTorch operations instead; the tests check both ways against each other.
:func:`set_cpu_kernels` is the one switch between the two at run time; every operation of
``linvit_mm.ops`` asks :func:`use_cpu_kernels`.

The kernels are called through PyTorch operators of the ``linvit_mm`` namespace
(``torch.library.custom_op``, defined beside their callers), so that ``torch.export`` and
``torch.compile`` see one operator with a shape function where the extension could not run
on the tensors they trace with; an exported program then calls the kernels, or their
PyTorch forms where the kernels do not apply. :func:`torch_forms` is the decomposition
table that replaces each operator by its PyTorch form, for programs that must not depend on
linvit_mm (ONNX, or a ``.pt2`` file loaded without it).
"""
import contextlib
import hashlib
import os
import os.path as osp
import warnings

import torch

from ..utils.tracing import is_tracing

# The real path: torch's build file names the sources, and a process that imported the
# package through a link (site-packages/linvit_mm, see tools/setup_env.py) would
# otherwise make ninja rebuild what a process importing from the source tree built.
CSRC = osp.join(osp.dirname(osp.realpath(__file__)), 'csrc')
SOURCES = ('bindings.cpp', 'depthwise.cpp', 'hedgehog_core.cpp', 'mhla_core.cpp',
           'ttt_inner.cpp')
_SOURCE_SUFFIXES = ('.c', '.cc', '.cpp', '.cxx', '.h', '.hh', '.hpp', '.inl', '.cu', '.cuh')
KERNEL_DTYPES = (torch.float32, torch.float64)
# The build is cached and may be reused on another CPU of the same user, so it targets the
# vector width torch itself dispatches to here (named in the extension), not -march=native.
_ARCH_FLAGS = {
    'AVX512': ['-mavx512f', '-mavx512dq', '-mavx512bw', '-mavx512vl', '-mavx2', '-mfma'],
    'AVX2': ['-mavx2', '-mfma'],
}
_UNLOADED = object()
_extension = _UNLOADED
_enabled = os.environ.get('LINVIT_MM_CPU_KERNELS', '1') != '0'
_TORCH_FORMS = {}


def _cflags(capability):
    return ['-O3', *_ARCH_FLAGS.get(capability, [])]


def source_digest(csrc=CSRC, capability=None):
    """sha256 (hex) of every C/C++ file under ``csrc`` (relative name and bytes, so an included
    header counts too), the compiler flags, torch's version and where ``csrc`` is: what the
    build depends on. Other files (an editor's swap file, notes) do not count. The place
    counts because torch's build file records absolute source paths: two checkouts sharing
    one name would rebuild it each time the other one imports."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha256()
    for flag in (osp.realpath(csrc), torch.__version__, *_cflags(capability)):
        digest.update(flag.encode() + b'\0')
    for root, dirs, names in os.walk(csrc):
        dirs.sort()
        for name in sorted(names):
            if not name.endswith(_SOURCE_SUFFIXES):
                continue
            path = osp.join(root, name)
            digest.update(osp.relpath(path, csrc).encode() + b'\0')
            with open(path, 'rb') as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def extension_name(csrc=CSRC, capability=None):
    """The name torch builds and caches the kernels of ``csrc`` under."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    return f'linvit_mm_cpu_kernels_{capability.lower()}_{source_digest(csrc, capability)[:16]}'


def build(csrc=CSRC, sources=SOURCES):
    """Compile (or take from torch's cache) the kernels of ``csrc`` and import them."""
    from torch.utils.cpp_extension import load
    capability = torch.backends.cpu.get_cpu_capability()
    return load(name=extension_name(csrc, capability),
                sources=[osp.join(csrc, name) for name in sources],
                extra_cflags=_cflags(capability))


def cpu_kernels():
    """The compiled module (built on the first call), or None where it cannot be built."""
    global _extension
    if _extension is _UNLOADED:
        _extension = None
        if os.environ.get('LINVIT_MM_CPU_KERNELS', '1') == '0':
            return None
        try:
            _extension = build()
        except Exception as err:  # no compiler or ninja, a read-only cache, ...
            warnings.warn(f'linvit_mm: the C++ CPU kernels could not be built, so the ttt, '
                          f'mhla and hedgehog operators and InLine\'s residual branch run on '
                          f'PyTorch operations (same results, slower on CPU). Set '
                          f'LINVIT_MM_CPU_KERNELS=0 to skip the attempt. Cause: {err}')
    return _extension


def set_cpu_kernels(enabled):
    """Use the C++ kernels where they apply (``True``) or PyTorch operations everywhere
    (``False``); returns the previous setting. Also a context manager::

        with set_cpu_kernels(False):
            ...   # runs on PyTorch operations
    """
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return _Restore(previous)


class _Restore(contextlib.AbstractContextManager):

    def __init__(self, previous):
        self.previous = previous

    def __bool__(self):
        return self.previous

    def __exit__(self, *exc):
        set_cpu_kernels(self.previous)


def use_cpu_kernels(*tensors):
    """Whether the kernels apply: switched on, CPU tensors of fp32 / fp64, innermost stride 1."""
    return _enabled and (all(t.device.type == 'cpu' and t.dtype in KERNEL_DTYPES
                             and t.stride(-1) == 1 for t in tensors)
                         and cpu_kernels() is not None)


def kernels_apply(*tensors):
    """Whether an operator's fused C++ form (``mhla_core``, ``hedgehog_core``) can run on
    ``tensors`` (the operator's inputs and parameters): eager code, the kernels switched on and
    built, CPU tensors of one fp32 / fp64 dtype with a channel stride of 1. Traced code takes
    the operators' PyTorch forms, which export as plain PyTorch operations."""
    return (not is_tracing() and len({t.dtype for t in tensors}) == 1
            and use_cpu_kernels(*tensors))


def register_torch_form(operator, form):
    """Record ``form``, the PyTorch operations that compute ``operator`` (an ``OpOverload``
    of the ``linvit_mm`` namespace) from its arguments, for :func:`torch_forms`."""
    _TORCH_FORMS[operator] = form


def torch_forms():
    """``{linvit_mm operator: its PyTorch form}``, a decomposition table::

        exported = torch.export.export(model, args).run_decompositions(torch_forms())

    leaves PyTorch operators only: what ``torch.onnx.export`` translates, and a program that
    runs without linvit_mm (on the CPU without the C++ kernels' speed)."""
    return dict(_TORCH_FORMS)
