"""The initialisation settings of the paper (Table A) as named presets of components.

A *component* is a group of Softmax ViT tensors, named as mmpretrain names them (see
:mod:`linvit_mm.transfer.checkpoint`); ``N`` runs over the blocks:

============  ===========================================================================
component     tensors
============  ===========================================================================
attention     ``backbone.layers.N.attn.{qkv,proj}.{weight,bias}`` (+ layer scale ``gamma1``)
mlp           ``backbone.layers.N.ffn.layers.{0.0,1}.{weight,bias}`` (SwiGLU:
              ``ffn.{w12,norm,w3}.*``) (+ ``gamma2``) **and** ``backbone.layers.N.ln2.*``, the
              norm that feeds the MLP
norms         the other norms: ``backbone.layers.N.ln1.*`` (feeds the attention), the final
              norm ``backbone.ln1.*``, the pooled-token norm ``backbone.ln2.*``,
              ``backbone.pre_norm.*``
patch_embed   ``backbone.patch_embed.projection.{weight,bias}``
pos_embed     ``backbone.pos_embed`` (resized when the patch grid differs)
cls_token     ``backbone.cls_token``
registers     ``backbone.register_tokens`` (DINOv2 with registers, DINOv3)
head          ``head.layers.head.*``, ``head.layers.pre_logits.*``
============  ===========================================================================

Why ``ln2`` travels with the MLP: a pre-norm block computes ``fc2(act(fc1(ln2(x))))``.
``ln2``'s affine weight and bias act on the MLP's input only, so ``fc1`` was trained on
``w * normalise(x) + b`` with the checkpoint's ``w, b``. Copying ``fc1`` without them hands
the copied MLP inputs with per-channel scales and offsets it never saw (the default
``w = 1, b = 0`` instead of the trained ones), so the "copied" MLP would not compute what it
computed in the Softmax model. ``ln2`` feeds nothing else, so copying it cannot disturb the
new attention operator; ``ln1`` feeds the attention and stays with the ``norms`` component.

Settings (paper Table A) and the components they copy:

=========  =========================================  ===================================
setting    copied from the Softmax checkpoint         initialised analytically
=========  =========================================  ===================================
random     nothing (the default DeiT/timm init)       -
mimetic    nothing                                    q/k/v/proj (Mimetic)
impulse    nothing                                    q/k/v/proj, learned ``pos_embed``
                                                      scaled (Impulse)
copy       attention                                  -
mlpcopy    mlp (with ``ln2``)                         -
fullcopy   all eight components                       -
=========  =========================================  ===================================

Table G (FullCopy without the class token, or the position or patch embedding) is the
component form, e.g. ``components=['attention', 'mlp', 'norms', 'patch_embed',
'pos_embed', 'head']`` for "FullCopy w/o cls token".
"""
import re

__all__ = ['COMPONENTS', 'SETTINGS', 'ANALYTIC_SETTINGS', 'resolve_setting', 'component_of',
           'is_softmax_tensor', 'block_index']

COMPONENTS = ('attention', 'mlp', 'norms', 'patch_embed', 'pos_embed', 'cls_token', 'registers',
              'head')

# name -> (components copied from the checkpoint, analytic initialisation or None)
SETTINGS = {
    'random': ((), None),
    'mimetic': ((), 'mimetic'),
    'impulse': ((), 'impulse'),
    'copy': (('attention', ), None),
    'mlpcopy': (('mlp', ), None),
    'fullcopy': (COMPONENTS, None),
}
ANALYTIC_SETTINGS = tuple(name for name, (_, analytic) in SETTINGS.items() if analytic)

# mmpretrain names of a Softmax ViT, grouped by component. Anything else a model holds is
# specific to its operator or architecture and has no counterpart in a checkpoint.
_BLOCK = r'backbone\.layers\.(\d+)\.'
_PATTERNS = {
    'attention': [_BLOCK + r'attn\.(qkv|proj)\.(weight|bias)$', _BLOCK + r'attn\.gamma1\.weight$'],
    'mlp': [_BLOCK + r'ffn\.layers\.(0\.0|1)\.(weight|bias)$', _BLOCK + r'ffn\.gamma2\.weight$',
            _BLOCK + r'ffn\.(w12|norm|w3)\.(weight|bias)$', _BLOCK + r'ln2\.(weight|bias)$'],
    'norms': [_BLOCK + r'ln1\.(weight|bias)$', r'backbone\.(ln1|ln2|pre_norm)\.(weight|bias)$'],
    'patch_embed': [r'backbone\.patch_embed\.projection\.(weight|bias)$'],
    'pos_embed': [r'backbone\.pos_embed$'],
    'cls_token': [r'backbone\.cls_token$'],
    'registers': [r'backbone\.register_tokens$'],
    'head': [r'head\.layers\.(head|pre_logits)\.(weight|bias)$'],
}
_PATTERNS = {name: [re.compile(p) for p in patterns] for name, patterns in _PATTERNS.items()}
# Where tensors a Softmax ViT lacks belong (an operator's extras sit in its block's attn).
_AREAS = {
    'attention': re.compile(_BLOCK + r'attn\.'),
    'mlp': re.compile(_BLOCK + r'(ffn|ln2)\.'),
    'norms': re.compile(_BLOCK + r'ln1\.|backbone\.(ln1|ln2|pre_norm)\.'),
    'patch_embed': re.compile(r'backbone\.patch_embed\.'),
    'head': re.compile(r'head\.'),
}
_BLOCK_RE = re.compile(_BLOCK)


def resolve_setting(setting=None, components=None):
    """``(setting name or None, components tuple, analytic name or None)``.

    Exactly one of ``setting`` and ``components`` must be given.
    """
    if setting is not None and components is not None:
        raise ValueError(f'give either setting ({setting!r}) or components ({components!r}), '
                         f'not both: each setting is a preset of components '
                         f'(linvit_mm.transfer.SETTINGS)')
    if setting is None and components is None:
        raise ValueError(f'give a setting (one of {", ".join(SETTINGS)}) or a list of '
                         f'components (a subset of {", ".join(COMPONENTS)})')
    if setting is not None:
        if setting not in SETTINGS:
            raise ValueError(f'unknown transfer setting {setting!r}; valid settings are: '
                             f'{", ".join(SETTINGS)}')
        selected, analytic = SETTINGS[setting]
        return setting, tuple(selected), analytic
    if isinstance(components, str):
        components = [components]
    if not isinstance(components, (list, tuple)):
        raise TypeError(f'components must be a list of component names, got '
                        f'{type(components).__name__}')
    unknown = [name for name in components if name not in COMPONENTS]
    if unknown:
        raise ValueError(f'unknown transfer component(s) {unknown}; valid components are: '
                         f'{", ".join(COMPONENTS)}')
    return None, tuple(name for name in COMPONENTS if name in components), None


def component_of(name):
    """The component of a full (prefixed) mmpretrain name, or None if it belongs to none."""
    for component, patterns in _PATTERNS.items():
        if any(p.match(name) for p in patterns):
            return component
    for component, area in _AREAS.items():
        if area.match(name):
            return component
    return None


def is_softmax_tensor(name):
    """Whether a Softmax ViT checkpoint can hold this (full, prefixed) name."""
    return any(p.match(name) for patterns in _PATTERNS.values() for p in patterns)


def block_index(name):
    match = _BLOCK_RE.match(name)
    return int(match.group(1)) if match else None
