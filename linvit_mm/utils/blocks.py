"""Block indices as the hooks, aligners and hybrid layouts take them."""
import numbers


def is_block_index(value):
    """An int (numpy ints too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def block_index_list(layers, verb):
    """``layers`` as a list of block indices, or None (every block) unchanged.

    ``verb`` names what the blocks are chosen for (``'distil'``, ``'align'``), in the errors.
    Refuses a string or other non-list, an empty list and entries that are not ints; the
    range is the caller's to check, as only it knows the depth.
    """
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not hasattr(layers, '__iter__'):
        raise TypeError(f'layers must be a list of block indices, got {layers!r}')
    layers = list(layers)
    if not layers:
        raise ValueError(f'layers=[] selects no block to {verb}; list the block indices, or '
                         f'leave layers unset (None) to {verb} every block')
    bad = [i for i in layers if not is_block_index(i)]
    if bad:
        raise TypeError(f'layers must be block indices (ints), got {bad} in {layers}')
    return layers
