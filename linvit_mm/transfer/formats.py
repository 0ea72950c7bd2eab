"""Which layout a Softmax ViT checkpoint has, and which encoder inside it to read.

Layouts recognised (``source_format``; the label names the *layout*, and a file written by
another tool in the same layout gets the same label):

- ``'deit-official'``: ``{'model': timm keys, ...}`` (DeiT releases and training
  checkpoints; MoCo v3's ``convert_to_deit.py`` output).
- ``'timm'``: a bare timm state dict (also DINO's backbone-only releases), or a timm
  ``train.py`` checkpoint ``{'state_dict': ..., 'arch': ..., 'version': ...}``.
- ``'mmpretrain'``: ``{'state_dict': {'backbone.*', 'head.*', ...}, 'meta': ...}``,
  or a bare dict with those keys.
- ``'dino'``: a full DINO checkpoint ``{'teacher', 'student', 'dino_loss', ...}``
  (the teacher is used, as DINO evaluates it) or a bare ``backbone.``/``head.``
  wrapper state dict.
- ``'mocov3'``: ``{'state_dict': {'module.base_encoder.*', 'module.momentum_encoder.*',
  'module.predictor.*'}, 'arch': ...}`` (the base encoder is used, without its
  projection MLP).
- ``'ibot'``: full iBOT checkpoints (``'ibot_loss'`` next to teacher/student) and the
  released ``{'state_dict': ...}`` backbone files, with or without ``backbone.``.
- ``'mae'``: ``{'model': ...}`` with the decoder (``decoder_*``, ``mask_token``) or the
  global-pool ``fc_norm`` of MAE fine-tuned models.
- ``'dinov2'``, ``'dinov3'``, ``'eva02'``, ``'clip'``: the original releases of those
  families (bare or in any of the containers above), converted to timm's names as timm's
  ``checkpoint_filter_fn`` does (:mod:`linvit_mm.transfer.releases`).

In timm's names, EVA's query/value biases and separate q/k/v projections and SwiGLU's split
gate/value layers are folded into a plain ViT's ``qkv`` / ``fc1``
(:func:`~linvit_mm.transfer.releases.merge_timm_variants`), and a SwiGLU MLP is read with
its own key map.

Files are read with ``torch.load(weights_only=True)`` first; one that also pickles
training metadata (the ``args`` namespace of DeiT / DINO / MAE releases, numpy scalars,
mmengine run metadata) is read by ``linvit_mm.utils.checkpoint``'s restricted unpickler,
which allows exactly those. These are external files: a pickle that carries code is
refused, never executed.
"""
import os
import pickle
from collections import OrderedDict
from typing import Dict, List, Mapping, NamedTuple

import torch

from linvit_mm.utils.checkpoint import UnsafeCheckpointError, load_checkpoint_file

from .key_maps import KEY_MAPS, TIMM_KEYS, UNMAPPED_GROUP, KeyMap, timm_key_map
from .releases import RELEASES, find_release, merge_timm_variants

__all__ = ['KNOWN_FORMATS', 'Encoder', 'read_source', 'find_encoder', 'refuse_non_finite',
           'refuse_non_finite_checkpoint', 'refuse_non_float']

# layout -> (what it looks like, the key map of its tensor names)
_FORMATS = {
    'deit-official': ("{'model': timm keys} (DeiT releases / training checkpoints)", 'timm'),
    'timm': ('bare timm state dict (blocks.N.attn.qkv, patch_embed.proj, norm, head)', 'timm'),
    'mmpretrain': ("{'state_dict': {'backbone.layers.N...', 'head.layers.head...'}, "
                   "'meta': ...}", 'mmpretrain'),
    'dino': ("DINO full checkpoint {'teacher', 'student', ...} or backbone./head. dict",
             'timm'),
    'mocov3': ("{'state_dict': {'module.base_encoder...', 'module.momentum_encoder...'}}",
               'timm'),
    'ibot': ("iBOT full checkpoint {'teacher', 'student', 'ibot_loss'} or "
             "{'state_dict': ...} backbone file", 'timm'),
    'mae': ("{'model': encoder keys + decoder_*/mask_token, or fc_norm (fine-tuned)}", 'timm'),
    **{release.name: (release.description, 'timm') for release in RELEASES.values()},
}
KNOWN_FORMATS = {name: description for name, (description, _) in _FORMATS.items()}

_METHOD_NAMES = {'dino': 'DINO', 'ibot': 'iBOT'}
_NON_TENSOR_GROUP = 'non-tensor entries'
_MAX_NAMED = 5


class Encoder(NamedTuple):
    """The Softmax encoder found in a checkpoint."""
    source_format: str
    key_map: KeyMap
    # its tensors, ``module.`` and encoder prefixes stripped
    state: Dict[str, torch.Tensor]
    # keys left out with the choice of encoder, grouped by why
    unused_groups: Dict[str, List[str]]
    notes: List[str]


def read_source(path_or_state, map_location='cpu'):
    """``(raw checkpoint mapping, how to name it in messages)`` from a path or a loaded one."""
    if isinstance(path_or_state, (str, os.PathLike)):
        where = os.fspath(path_or_state)
        raw = _read_file(where, map_location)
    elif isinstance(path_or_state, Mapping):
        where = 'the given checkpoint'
        raw = path_or_state
    else:
        raise TypeError('load_softmax_checkpoint expects a checkpoint path or a loaded '
                        f'checkpoint mapping, got {type(path_or_state).__name__}')
    if not isinstance(raw, Mapping):
        raise ValueError(f'{where}: expected a dict-like checkpoint, the file holds a '
                         f'{type(raw).__name__}. Known formats:\n{_formats_text()}')
    return raw, where


def _read_file(path, map_location):
    """Read a weight file or an mmengine run checkpoint without running code.

    ``load_checkpoint_file`` allows tensors, plain containers, numpy data, mmengine's
    run metadata and argparse namespaces (the ``args`` of DeiT, DINO, iBOT and MAE
    training checkpoints); any other pickled object is refused.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f'Softmax ViT checkpoint not found: {path!r}')
    try:
        return load_checkpoint_file(path, map_location=map_location)
    except UnsafeCheckpointError as err:
        raise ValueError(
            f'refused to load {err}. Weight files are read without executing '
            'anything they carry; if you trust this file, load it yourself and pass the '
            'loaded dict, or its state_dict, to load_softmax_checkpoint.') from None
    except pickle.UnpicklingError as err:
        raise ValueError(f'{path!r} is not a PyTorch checkpoint: torch.load cannot '
                         f'unpickle it ({_last_line(err)}).') from None
    except (RuntimeError, EOFError, KeyError, IndexError, OSError) as err:
        raise ValueError(f'{path!r} is not a PyTorch checkpoint: torch.load cannot '
                         f'read it ({type(err).__name__}: {err}).') from None


def _last_line(err):
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    specific = [line for line in lines if line.startswith('Unsupported')]
    return (specific or lines or [repr(err)])[0]


def _formats_text():
    return '\n'.join(f'  {name}: {desc}' for name, desc in KNOWN_FORMATS.items())


def refuse_non_float(state, origins, where):
    """Raise if a tensor that could be copied is not floating point: a copy would cast an
    integer or boolean tensor into a weight (a damaged or quantised file, not a ViT's)."""
    bad = [name for name, tensor in state.items() if not tensor.is_floating_point()]
    if not bad:
        return
    listed = [f'{name}' + (f' ({origins[name]})' if origins.get(name, name) != name else '')
              + f': {state[name].dtype}' for name in bad[:_MAX_NAMED]]
    more = f'\n  ... and {len(bad) - _MAX_NAMED} more' if len(bad) > _MAX_NAMED else ''
    raise ValueError(f'{where}: {len(bad)} weight tensor(s) are not floating point:\n  '
                     + '\n  '.join(listed) + f'{more}\nA copy would cast them into the '
                     f'model\'s floating-point weights. Refused before anything is copied; '
                     f'use the checkpoint in the precision it was trained in.')


def refuse_non_finite(state, origins, where, advice=None):
    """Raise if a tensor that could be copied holds NaN or Inf (a diverged or damaged run).

    ``advice`` replaces the closing sentence (what to do instead), for callers with an opt-out.
    """
    bad = [(name, tensor) for name, tensor in state.items()
           if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if not bad:
        return
    listed = []
    for name, tensor in bad[:_MAX_NAMED]:
        counts = [f'{int(count)} {kind}' for kind, count in (
            ('NaN', torch.isnan(tensor).sum()), ('Inf', torch.isinf(tensor).sum())) if count]
        source = origins.get(name, name)
        listed.append(f'{name}' + (f' ({source})' if source != name else '')
                      + f': {", ".join(counts)} of {tensor.numel()}')
    more = f'\n  ... and {len(bad) - _MAX_NAMED} more' if len(bad) > _MAX_NAMED else ''
    raise ValueError(f'{where}: {len(bad)} tensor(s) hold non-finite values (NaN / Inf), as a '
                     f'diverged or damaged training run leaves them:\n  ' + '\n  '.join(listed)
                     + f'{more}\n' + (advice or 'Refused before anything is copied; use a '
                                       'checkpoint saved before the run diverged.'))


def refuse_non_finite_checkpoint(checkpoint, where, advice):
    """:func:`refuse_non_finite` on the tensors of a loaded checkpoint (its ``state_dict``, or
    the file itself when it is a bare state dict), for the tools that load one."""
    state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else {}
    tensors = {key: value for key, value in state.items() if torch.is_tensor(value)} \
        if isinstance(state, dict) else {}
    refuse_non_finite(tensors, {}, where, advice)


def _is_tensor_dict(obj):
    return (isinstance(obj, Mapping) and all(isinstance(key, str) for key in obj)
            and any(torch.is_tensor(value) for value in obj.values()))


def _strip_module(state):
    """Drop the ``module.`` prefixes that DataParallel / DDP wrapping adds."""
    stripped = OrderedDict()
    for key, value in state.items():
        while key.startswith('module.'):
            key = key[len('module.'):]
        stripped[key] = value
    return stripped


def _split_prefix(state, prefix):
    selected = OrderedDict((key[len(prefix):], value) for key, value in state.items()
                           if key.startswith(prefix))
    rest = [key for key in state if not key.startswith(prefix)]
    return selected, rest


def _has_prefix(state, prefix):
    return any(key.startswith(prefix) for key in state)


def _describe_entries(raw, names):
    parts = []
    for name in names:
        value = raw[name]
        if _is_tensor_dict(value):
            parts.append(f"{name} ({len(value)} tensor{'s' if len(value) > 1 else ''})")
        else:
            parts.append(name)
    return ', '.join(parts)


def _unrecognised(where, raw, model_dict):
    top = list(raw)[:8]
    examples = list(model_dict)[:6] if model_dict is not None else []
    return ValueError(
        f'{where}: unrecognised checkpoint layout. Top-level keys: {top}; example '
        f'tensor keys: {examples}. A plain ViT with blocks.N.attn.qkv (timm) or '
        f'backbone.layers.N.attn.qkv (mmpretrain) is expected. Known formats:\n'
        f'{_formats_text()}')


def find_encoder(raw, where):
    """Find the Softmax encoder's state dict inside the checkpoint ``raw``.

    Returns:
        Encoder: its layout, key map, tensors, the keys the choice left out and notes.
    """
    notes = []
    prefix_groups = {}

    container = next((name for name in ('teacher', 'state_dict', 'model')
                      if _is_tensor_dict(raw.get(name))), None)
    if container is None:
        if not _is_tensor_dict(raw):
            raise _unrecognised(where, raw, None)
        model_dict = raw
    else:
        model_dict = raw[container]
        others = [name for name in raw if name != container]
        if others:
            notes.append(f"read the '{container}' entry; ignored top-level entries: "
                         f'{_describe_entries(raw, others)}')

    # Values that are not tensors (mmengine's _metadata is an attribute, but some
    # tools leave version numbers in the dict) cannot be weights.
    non_tensor = [key for key, value in model_dict.items() if not torch.is_tensor(value)]
    if non_tensor:
        prefix_groups[_NON_TENSOR_GROUP] = non_tensor
    model_dict = _strip_module(OrderedDict(
        (key, value) for key, value in model_dict.items() if torch.is_tensor(value)))

    def found(source_format, state):
        key_map = KEY_MAPS[_FORMATS[source_format][1]]
        if key_map is TIMM_KEYS:
            state, merge_notes = merge_timm_variants(state)
            notes.extend(merge_notes)
            key_map = timm_key_map(state)
        if not key_map.has_blocks(state):
            raise _unrecognised(where, raw, state)
        return Encoder(source_format, key_map, state, prefix_groups, notes)

    if (_has_prefix(model_dict, 'backbone.layers.')
            or _has_prefix(model_dict, 'backbone.patch_embed.projection.')):
        return found('mmpretrain', model_dict)

    release = find_release(model_dict)
    if release is not None:
        state, groups, release_notes = release.convert(model_dict)
        for group, keys in groups.items():
            prefix_groups.setdefault(group, []).extend(keys)
        notes.extend(release_notes)
        return found(release.name, state)

    if _has_prefix(model_dict, 'base_encoder.'):
        encoder, rest = _split_prefix(model_dict, 'base_encoder.')
        _group_rest(prefix_groups, rest, {
            'momentum_encoder.': 'MoCo v3 momentum encoder',
            'predictor.': 'MoCo v3 predictor MLP'})
        notes.append('MoCo v3: using base_encoder (momentum_encoder and predictor '
                     'ignored; base_encoder.head is the projection MLP)')
        return found('mocov3', encoder)

    if _has_prefix(model_dict, 'backbone.blocks.'):
        encoder, rest = _split_prefix(model_dict, 'backbone.')
        _group_rest(prefix_groups, rest, {'head.': 'self-supervised projection head'})
        # DINO saves teacher/student; iBOT's released backbone files use 'state_dict'.
        source_format = ('ibot' if container == 'state_dict'
                         or _looks_like_ibot(raw, model_dict) else 'dino')
        if container == 'teacher':
            method = _METHOD_NAMES[source_format]
            notes.append(f'{method}: using the teacher (the network {method} evaluates); '
                         'the student is ignored')
        return found(source_format, encoder)

    has_decoder = (_has_prefix(model_dict, 'decoder_') or 'mask_token' in model_dict)
    if container == 'teacher':
        source_format = 'ibot' if _looks_like_ibot(raw, model_dict) else 'dino'
        notes.append(f'{_METHOD_NAMES[source_format]}: using the teacher; the student '
                     'is ignored')
    elif has_decoder or (container == 'model' and 'fc_norm.weight' in model_dict):
        source_format = 'mae'
    elif container == 'model':
        source_format = 'deit-official'
    elif container == 'state_dict':
        # timm's train.py writes 'arch' and 'version' beside its state_dict; iBOT's
        # released backbone files hold nothing else.
        source_format = ('ibot' if _looks_like_ibot(raw, model_dict)
                         or set(raw) == {'state_dict'} else 'timm')
    else:
        source_format = 'timm'
    return found(source_format, model_dict)


def _looks_like_ibot(raw, model_dict):
    if 'ibot_loss' in raw:
        return True
    # iBOT's student has a learnt mask embedding and its head a second (patch) branch.
    return any(key.endswith('masked_embed') or '.last_layer2.' in key
               or key.startswith('head.mlp2.') for key in model_dict)


def _group_rest(groups, keys, prefixes):
    for key in keys:
        group = next((name for prefix, name in prefixes.items()
                      if key.startswith(prefix)), UNMAPPED_GROUP)
        groups.setdefault(group, []).append(key)
