"""The PyTorch forms of linvit_mm's operators, as a decomposition table.

Operators of the ``linvit_mm`` namespace (``torch.library.custom_op``, defined beside their
callers) are single nodes to ``torch.export`` and ``torch.compile``. A program that must not
depend on linvit_mm (ONNX, or a ``.pt2`` file loaded without it) replaces each of them by the
PyTorch operations that compute it: :func:`torch_forms` is that table.
"""
_TORCH_FORMS = {}


def register_torch_form(operator, form):
    """Record ``form``, the PyTorch operations that compute ``operator`` (an ``OpOverload``
    of the ``linvit_mm`` namespace) from its arguments, for :func:`torch_forms`."""
    _TORCH_FORMS[operator] = form


def torch_forms():
    """``{linvit_mm operator: its PyTorch form}``, a decomposition table::

        exported = torch.export.export(model, args).run_decompositions(torch_forms())

    leaves PyTorch operators only: what ``torch.onnx.export`` translates, and a program that
    runs without linvit_mm."""
    return dict(_TORCH_FORMS)
