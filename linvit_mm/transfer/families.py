"""Source families: the pre-trained ViT families a checkpoint can come from, how its tensors
show which one, and what they tell that no tensor shape does (the head count, the RoPE).

A checkpoint's :class:`Architecture` is read from its tensors (mmpretrain names). Each
:class:`Family` states what a checkpoint of it must have; the family of a checkpoint is the
one its release layout names (``dinov2``, ``dinov3``, ``eva02``, ``clip``), else the first in
:data:`FAMILIES` whose requirements its tensors meet, or the one the caller states
(``family=``, checked against the same requirements). A family fixes:

- whether and how its attention rotates queries and keys (2-D RoPE): the tensors cannot
  show it, since RoPE has no parameters;
- its head count at each of its released widths (all of them 64-channel heads, except
  DINOv3's 7B), so copying attention into a model with another count is refused even when
  the file records no ``num_heads``.

All of it is read from the families of LinearViT's arch table
(:data:`linvit_mm.models.backbones.arch_zoo.FAMILIES`): the RoPE is its switches' ``rope``,
the requirements are what its switches (registers, LayerScale, MLP, position embedding,
pre-norm) imply for the fields it is ``recognised_by``, so an arch word and the family of its
checkpoints cannot disagree.
"""
from collections import OrderedDict
from typing import Callable, Dict, List, NamedTuple, Optional

from ..models.backbones import arch_zoo as _arch_zoo

__all__ = ['Architecture', 'Family', 'FAMILIES', 'read_architecture', 'resolve_family',
           'family_heads', 'known_families_text']


class Architecture(NamedTuple):
    """What a checkpoint's tensors (mmpretrain names) say about its architecture."""
    num_register_tokens: int
    layer_scale: bool          # LayerScale (gamma1 / gamma2) in the blocks
    ffn_type: str              # 'mlp' or 'swiglu'
    ffn_norm: bool             # a norm of the SwiGLU hidden features (EVA-02 sub-LN)
    pre_norm: bool             # a norm before the blocks (CLIP)
    qkv_bias: bool
    pos_embed: bool            # an absolute (learned) position embedding
    pos_embed_extra_tokens: Optional[int]   # its extra-token slots, if it has one


def read_architecture(state, pos_embed_extra_tokens):
    """The :class:`Architecture` of the mapped tensors ``state``."""
    def any_block(suffix):
        return any(key.startswith('backbone.layers.') and key.endswith(suffix) for key in state)

    registers = state.get('backbone.register_tokens')
    return Architecture(
        num_register_tokens=int(registers.shape[1]) if registers is not None else 0,
        layer_scale=any_block('.attn.gamma1.weight') or any_block('.ffn.gamma2.weight'),
        ffn_type='swiglu' if any_block('.ffn.w12.weight') else 'mlp',
        ffn_norm=any_block('.ffn.norm.weight'),
        pre_norm='backbone.pre_norm.weight' in state,
        qkv_bias=any_block('.attn.qkv.bias'),
        pos_embed='backbone.pos_embed' in state,
        pos_embed_extra_tokens=pos_embed_extra_tokens)


class Family(NamedTuple):
    """A source family.

    Attributes:
        name: its name (``family=``).
        description: what it is, for messages.
        rope: the 2-D RoPE its attention uses (``'eva'``, ``'dinov3'``) or None.
        heads: ``{embed_dims: num_heads}`` of its released models.
        contradictions: ``Architecture -> [what does not fit]``; empty if a checkpoint with
            that architecture can be of this family.
    """
    name: str
    description: str
    rope: Optional[str]
    heads: Dict[int, int]
    contradictions: Callable[[Architecture], List[str]]


def _needs(**wanted):
    """Contradictions of an architecture with the ``wanted`` values (callables test)."""
    def contradictions(arch):
        found = []
        for field, want in wanted.items():
            value = getattr(arch, field)
            ok = want(value) if callable(want) else value == want
            if not ok:
                found.append(f'{field}={value!r}')
        return found
    return contradictions


def _implied(switches):
    """What a checkpoint of a model with these switches shows, per ``Architecture`` field:
    the value, or a test of it."""
    switches = dict(_arch_zoo.ARCH_SWITCH_DEFAULTS, **switches)
    with_registers = switches['num_register_tokens'] > 0
    implied = dict(
        layer_scale=switches['layer_scale_init_value'] > 0,
        # a family's register count is not a requirement: whether it has registers is
        num_register_tokens=(lambda n: n > 0) if with_registers else 0,
        pos_embed=switches['pos_embed_type'] == 'learned',
        ffn_type=switches['ffn_type'],
        pre_norm=switches['pre_norm'])
    if switches['no_embed_class']:
        implied['pos_embed_extra_tokens'] = 0  # the embedding covers the patches only
    return implied


def _family(name, entry):
    implied = _implied(entry['switches'])
    rope = entry['switches'].get('rope')
    return Family(name, entry['description'], rope['type'] if rope else None,
                  dict(entry['heads']),
                  _needs(**{field: implied[field] for field in entry['recognised_by']}))


# In the order a checkpoint's family is inferred: the first whose requirements hold.
FAMILIES = OrderedDict((name, _family(name, entry)) for name, entry in _arch_zoo.FAMILIES.items())


def known_families_text():
    return '; '.join(f'{name}: {family.description}' for name, family in FAMILIES.items())


def resolve_family(arch, release_family=None, given=None):
    """The family of a checkpoint with architecture ``arch``.

    Args:
        arch (Architecture): read from its tensors.
        release_family (str, optional): the family its release layout names.
        given (str, optional): the family the caller states.

    Returns:
        tuple: ``(family name or None, how it is known, notes)``.

    Raises:
        ValueError: ``given`` is not a known family, or the checkpoint cannot be of it
            (its layout is another family's release, or its tensors contradict it).
    """
    notes = []
    if given is not None:
        if given not in FAMILIES:
            raise ValueError(f'unknown source family {given!r}; known families are: '
                             f'{known_families_text()}')
        if release_family is not None and release_family != given:
            raise ValueError(f'family={given!r} was given, but the checkpoint is a '
                             f'{release_family!r} release; drop family= or give '
                             f'{release_family!r}')
        contradictions = FAMILIES[given].contradictions(arch)
        if contradictions:
            raise ValueError(f'family={given!r} was given, but the checkpoint cannot be a '
                             f'{FAMILIES[given].description} checkpoint: it has '
                             f'{", ".join(contradictions)}; drop family= to have it inferred')
        return given, f'given as family={given!r}', notes
    if release_family is not None:
        return release_family, f'its {release_family} release layout', notes
    for name, family in FAMILIES.items():
        if not family.contradictions(arch):
            return name, 'its tensors', notes
    notes.append(f'the source family is unknown: the tensors fit none of the known families '
                 f'({", ".join(FAMILIES)}); whether its attention used RoPE is unknown '
                 f'(state it with family=)')
    return None, None, notes


def family_heads(family, embed_dims):
    """``(num_heads, where from)`` of the family's released model of that width, or
    ``(None, None)``."""
    heads = FAMILIES[family].heads.get(embed_dims) if family in FAMILIES else None
    if heads is None:
        return None, None
    return heads, f'the {family} family at width {embed_dims}'
