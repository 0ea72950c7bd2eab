"""The strict check of a checkpoint's tensors against a model, before anything is loaded.

One rule for every strict load of the project (the ViT-Adapter's ViT checkpoint,
``LinearViTCheckpoint``, the Runner's ``load_from`` / ``--resume``): every tensor of the model
must be in the checkpoint with its shape, and the checkpoint may hold no other, except that a
LinearViT's learned ``pos_embed`` may cover another square grid of the same width, which the
ViT's load hook resamples to its own.

Only the models' attributes are read here (no import of the models), so that both the model
and the engine layers may use it.
"""
import math

__all__ = ['LISTED_KEYS', 'resizable_pos_embed', 'state_problems']

# Names listed per kind of key problem before the rest is counted.
LISTED_KEYS = 20


def resizable_pos_embed(vit, tensor):
    """Whether ``vit`` (a LinearViT) resamples this checkpoint ``pos_embed`` to its own grid
    on load: the model has a learned embedding, and ``tensor`` is ``(1, slots + n * n, C)``
    with the model's extra-token slots and width."""
    if getattr(vit, 'pos_embed', None) is None or tensor.dim() != 3 or tensor.shape[0] != 1:
        return False
    patches = tensor.shape[1] - vit.pos_embed_extra_tokens
    side = math.isqrt(max(patches, 0))
    return patches > 0 and side * side == patches and tensor.shape[2] == vit.embed_dims


def _listed(keys):
    keys = sorted(keys)
    shown = ', '.join(keys[:LISTED_KEYS])
    return shown + (f' and {len(keys) - LISTED_KEYS} more' if len(keys) > LISTED_KEYS else '')


def state_problems(expected, state, name_prefix='', vits=None, against='model'):
    """How the tensors of ``state`` differ from those ``expected``, one line per kind.

    Args:
        expected (Mapping): the model's state dict.
        state (Mapping): the checkpoint's, with the same key names.
        name_prefix (str): prepended to every key in the lines (the keys' prefix in the file
            when ``state`` holds them without it).
        vits (Mapping[str, LinearViT], optional): ``{key prefix: LinearViT}`` whose
            ``{prefix}pos_embed`` may be of another grid (:func:`resizable_pos_embed`).
        against (str): what the lines call the model's side (``'model'``, ``'config'``).

    Returns:
        list[str]: missing keys, unexpected keys, size-mismatched keys (each listed sorted, the
        first :data:`LISTED_KEYS` named); empty when ``state`` fits.
    """
    vits = vits or {}

    def resizable(key, tensor):
        return any(key == f'{prefix}pos_embed' and resizable_pos_embed(vit, tensor)
                   for prefix, vit in vits.items())

    missing = [name_prefix + key for key in expected if key not in state]
    unexpected = [name_prefix + key for key in state if key not in expected]
    mismatched = [
        f'{name_prefix}{key}: checkpoint {tuple(state[key].shape)}, {against} '
        f'{tuple(expected[key].shape)}'
        for key in sorted(set(expected) & set(state))
        if hasattr(state[key], 'shape') and hasattr(expected[key], 'shape')
        and tuple(state[key].shape) != tuple(expected[key].shape)
        and not resizable(key, state[key])]
    problems = []
    if missing:
        problems.append(f'missing keys (the model has them, the checkpoint not): '
                        f'{_listed(missing)}')
    if unexpected:
        problems.append(f'unexpected keys (in the checkpoint, not in the model): '
                        f'{_listed(unexpected)}')
    if mismatched:
        more = len(mismatched) - LISTED_KEYS
        problems.append('size-mismatched keys: ' + '; '.join(mismatched[:LISTED_KEYS])
                        + (f' and {more} more' if more > 0 else ''))
    return problems
