"""Read the Softmax ViT checkpoints people actually have, in mmpretrain names.

:func:`load_softmax_checkpoint` puts the three steps together: find the layout and the
encoder inside it (:mod:`linvit_mm.transfer.formats`), rename its tensors
(:mod:`linvit_mm.transfer.key_maps`) and read the architecture from them
(:mod:`linvit_mm.transfer.inference`).
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from .families import Architecture, FAMILIES, family_heads, read_architecture, resolve_family
from .formats import (KNOWN_FORMATS, find_encoder, read_source, refuse_non_finite,
                      refuse_non_float)
from .inference import check_num_heads, infer_layout, infer_num_heads
from .key_maps import map_keys, place_pooled_norm
from .linear_sources import refuse_linear_source
from .releases import RELEASES

__all__ = ['SoftmaxCheckpoint', 'load_softmax_checkpoint', 'KNOWN_FORMATS']


@dataclass
class SoftmaxCheckpoint:
    """A Softmax ViT checkpoint in mmpretrain names, with what was learnt reading it.

    Attributes:
        state_dict: tensors under ``backbone.*`` / ``head.*`` target names. Tensors
            are those read from the file (or given), not copies, except
            ``backbone.pos_embed`` when a distillation slot was dropped.
        source_format: the layout detected, one of :data:`KNOWN_FORMATS`.
        unused_keys: source keys (as in the chosen model dict, ``module.`` stripped)
            that were not mapped.
        unused_groups: the same keys grouped by why they are unused.
        notes: decisions taken while reading (which encoder was picked, slots
            dropped, ignored top-level entries), for the user to see.
        embed_dims, depth, patch_size: read from tensor shapes.
        num_heads: not inferable from shapes; set when the checkpoint's own metadata
            names it (an explicit ``num_heads`` or a known architecture name) or the
            reader was told (``num_heads=``).
        num_heads_from: where ``num_heads`` comes from, for messages.
        pos_grid: (h, w) of the patch part of ``backbone.pos_embed`` when square.
        num_extra_tokens: leading non-patch slots in ``backbone.pos_embed``
            (1 = class token slot; 0 = position embedding without a class slot, as in
            DeiT III or timm ``no_embed_class`` models).
        family: the source family (see :mod:`linvit_mm.transfer.families`), None if
            unknown; ``family_from`` says how it is known.
        rope: the 2-D RoPE of the family's attention (``'eva'``, ``'dinov3'``) or None
            (none, or an unknown family).
        num_register_tokens, layer_scale, ffn_type, ffn_norm, pre_norm, qkv_bias: read from
            the tensors (registers; LayerScale; ``'mlp'`` or ``'swiglu'``; SwiGLU's hidden
            norm; a norm before the blocks; a qkv bias).
    """
    state_dict: Dict[str, torch.Tensor]
    source_format: str
    unused_keys: List[str] = field(default_factory=list)
    unused_groups: Dict[str, List[str]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    embed_dims: Optional[int] = None
    depth: Optional[int] = None
    num_heads: Optional[int] = None
    num_heads_from: Optional[str] = None
    patch_size: Optional[Tuple[int, int]] = None
    pos_grid: Optional[Tuple[int, int]] = None
    num_extra_tokens: Optional[int] = None
    family: Optional[str] = None
    family_from: Optional[str] = None
    rope: Optional[str] = None
    num_register_tokens: int = 0
    layer_scale: bool = False
    ffn_type: str = 'mlp'
    ffn_norm: bool = False
    pre_norm: bool = False
    qkv_bias: bool = True

    def with_num_heads(self, num_heads):
        """This checkpoint with the head count ``num_heads`` stated by the caller.

        Raises:
            ValueError: ``num_heads`` does not divide the width or contradicts what the
                checkpoint itself states.
        """
        if num_heads is None:
            return self
        check_num_heads(num_heads, self.embed_dims, self.num_heads, self.num_heads_from)
        if self.num_heads == num_heads:
            return self
        return dataclasses.replace(
            self, num_heads=num_heads, num_heads_from=f'given as num_heads={num_heads}',
            notes=self.notes + [f'num_heads={num_heads} as given (the checkpoint does not '
                                f'state it)'])

    def with_family(self, family):
        """This checkpoint read as one of the source family ``family`` (see
        :func:`load_softmax_checkpoint`); itself when ``family`` is None or its own.

        Raises:
            ValueError: an unknown family, or one the checkpoint cannot be of.
        """
        if family is None or family == self.family:
            return self
        arch = Architecture(**{field: getattr(self, field) for field in (
            'num_register_tokens', 'layer_scale', 'ffn_type', 'ffn_norm', 'pre_norm',
            'qkv_bias')}, pos_embed='backbone.pos_embed' in self.state_dict,
            pos_embed_extra_tokens=self.num_extra_tokens)
        release = RELEASES.get(self.source_format)
        name, family_from, _ = resolve_family(arch, release.family if release else None, family)
        changes = dict(family=name, family_from=family_from, rope=FAMILIES[name].rope)
        if self.num_heads is None:
            heads, heads_from = family_heads(name, self.embed_dims)
            changes.update(num_heads=heads, num_heads_from=heads_from)
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        """Human-readable multi-line description (used by the converter CLI)."""
        heads = (f' ({self.num_heads_from})' if self.num_heads is not None else
                 ' (not recorded in the checkpoint; state it with num_heads / --num-heads)')
        lines = [
            f'source format   : {self.source_format}',
            f'mapped tensors  : {len(self.state_dict)}',
            f'embed_dims      : {self.embed_dims}',
            f'depth           : {self.depth}',
            f'num_heads       : {self.num_heads}{heads}',
            f'patch_size      : {self.patch_size}',
            f'pos_grid        : {self.pos_grid}',
            f'num_extra_tokens: {self.num_extra_tokens}',
            f'family          : {self.family}'
            + (f' ({self.family_from})' if self.family else ' (unknown; state it with family=)'),
            f'registers       : {self.num_register_tokens}',
            f'layer scale     : {self.layer_scale}',
            f'rope            : {self.rope}',
            f'mlp             : {self.ffn_type}' + (' with hidden norm' if self.ffn_norm else ''),
            f'pre-norm        : {self.pre_norm}',
            f'qkv bias        : {self.qkv_bias}',
            f'unused tensors  : {len(self.unused_keys)}',
        ]
        for group, keys in self.unused_groups.items():
            examples = ', '.join(keys[:3]) + (', ...' if len(keys) > 3 else '')
            lines.append(f'  - {group}: {len(keys)} ({examples})')
        lines += [f'note: {note}' for note in self.notes]
        return '\n'.join(lines)


def load_softmax_checkpoint(path_or_state, map_location='cpu', fc_norm_target='ln2',
                            num_heads=None, family=None) -> SoftmaxCheckpoint:
    """Read a Softmax ViT checkpoint of any known layout into mmpretrain names.

    Args:
        path_or_state: path of a checkpoint file, or an already loaded checkpoint
            (the object ``torch.load`` returned, or a bare state dict).
        map_location: passed to ``torch.load`` when reading a file (a loaded
            checkpoint keeps its tensors where they are).
        fc_norm_target (str): where a global-pool ``fc_norm`` (MAE fine-tuned, timm
            ``global_pool='avg'``) goes. ``'ln2'`` (default) is mmpretrain's norm of
            the pooled features (``out_type='avg_featmap', final_norm=False``): the
            same function. ``'ln1'`` makes it the final norm, for models that have
            no pooled norm (LinearViT); that norm then acts on the tokens before
            pooling, which is not the same function.
        num_heads (int, optional): the checkpoint's number of attention heads, for
            checkpoints that do not record it (shapes cannot tell). Checked against the
            width and against what the checkpoint's metadata (or its family's released
            models) state.
        family (str, optional): the source family (``vit``, ``deit3``, ``dinov2``,
            ``dinov3``, ``clip``, ``eva02``), for a checkpoint whose tensors do not tell it;
            checked against them. It fixes the RoPE and the head counts of the released
            widths.

    Returns:
        SoftmaxCheckpoint

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is not a weights-only PyTorch checkpoint, it is a
            linear-attention ViT's (ViT³, InLine, MHLA, LoLCATs / Hedgehog maps, a
            LinearViT of a linear operator: see
            :func:`~linvit_mm.transfer.linear_sources.detect_linear_source`), its layout
            is not one of :data:`KNOWN_FORMATS`, a tensor it maps is not floating point
            (an integer or boolean weight) or holds NaN or Inf,
            ``num_heads`` does not fit, or ``family`` is unknown or does not fit.
        TypeError: ``path_or_state`` is neither a path nor a mapping.
    """
    if fc_norm_target not in ('ln1', 'ln2'):
        raise ValueError(f"fc_norm_target must be 'ln1' or 'ln2', got {fc_norm_target!r}")
    if num_heads is not None:
        check_num_heads(num_heads, None)
    raw, where = read_source(path_or_state, map_location)
    refuse_linear_source(raw, where)
    encoder = find_encoder(raw, where)
    state_dict, origins, unused_groups, notes = map_keys(encoder.state, encoder.key_map)
    refuse_non_float(state_dict, origins, where)
    refuse_non_finite(state_dict, origins, where)
    notes = encoder.notes + notes
    place_pooled_norm(state_dict, fc_norm_target, notes)
    for group, keys in encoder.unused_groups.items():
        unused_groups.setdefault(group, []).extend(keys)
    unused_groups = {group: keys for group, keys in unused_groups.items() if keys}

    layout = infer_layout(state_dict, encoder.key_map.dist_token in encoder.state)
    arch = read_architecture(state_dict, layout.num_extra_tokens)
    release = RELEASES.get(encoder.source_format)
    family_name, family_from, family_notes = resolve_family(
        arch, release.family if release is not None else None, family)
    heads, heads_from, heads_notes = infer_num_heads(raw, encoder.source_format,
                                                     layout.embed_dims)
    if heads is None:
        heads, heads_from = family_heads(family_name, layout.embed_dims)
        if heads is not None:
            heads_notes.append(f'num_heads={heads} from {heads_from}')
    ckpt = SoftmaxCheckpoint(
        state_dict=state_dict,
        source_format=encoder.source_format,
        unused_keys=[key for keys in unused_groups.values() for key in keys],
        unused_groups=unused_groups,
        notes=notes + layout.notes + family_notes + heads_notes,
        embed_dims=layout.embed_dims,
        depth=layout.depth,
        num_heads=heads,
        num_heads_from=heads_from,
        patch_size=layout.patch_size,
        pos_grid=layout.pos_grid,
        num_extra_tokens=layout.num_extra_tokens,
        family=family_name,
        family_from=family_from,
        rope=FAMILIES[family_name].rope if family_name is not None else None,
        **{field: getattr(arch, field) for field in (
            'num_register_tokens', 'layer_scale', 'ffn_type', 'ffn_norm', 'pre_norm',
            'qkv_bias')})
    return ckpt.with_num_heads(num_heads)
