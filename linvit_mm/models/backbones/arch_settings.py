"""What an arch (a word of :mod:`~linvit_mm.models.backbones.arch_zoo` or a custom dict) and
a model's arguments resolve to: the four sizes and every architecture switch."""
import copy

from ..utils.options import check_option_types
from .arch_zoo import (ARCH_ALIASES, ARCH_ESSENTIALS, ARCH_SWITCH_DEFAULTS, ARCH_WORDS,
                       FAMILIES, FFN_TYPES, LINEAR_FAMILIES, OVERRIDABLE_SWITCHES)

POS_EMBED_TYPES = ('learned', 'sincos', 'none')


def family_switches(family, variant=None):
    """The switches a family's models (of its ``variant``, if given) set."""
    entry = FAMILIES.get(family) or LINEAR_FAMILIES[family]
    variants = entry.get('variants', {})
    if variant is not None and variant not in variants:
        raise KeyError(f'the {family!r} family has no variant {variant!r}; it has '
                       f'{sorted(variants)}')
    return copy.deepcopy(dict(entry['switches'], **variants.get(variant, {})))


def word_settings(word):
    """The settings of the arch word ``word`` (not an alias): its sizes, the head count of
    its family at its width and the switches of its family, variant and its own."""
    entry = copy.deepcopy(ARCH_WORDS[word])
    family, variant = entry.pop('family', None), entry.pop('variant', None)
    if family is None:
        return entry
    entry['num_heads'] = (FAMILIES.get(family) or LINEAR_FAMILIES[family])['heads'][
        entry['embed_dims']]
    sizes = {key: entry.pop(key) for key in ARCH_ESSENTIALS}
    return dict(sizes, **family_switches(family, variant), **entry)


def build_arch_zoo():
    """``{word: settings}`` of every arch word and alias."""
    zoo = {word: word_settings(word) for word in ARCH_WORDS}
    zoo.update({alias: zoo[word] for alias, word in ARCH_ALIASES.items()})
    return zoo


def resolve_arch(arch, arch_zoo):
    """The settings dict of an ``arch_zoo`` word or a custom dict: the four sizes
    (``embed_dims``, ``num_layers``, ``num_heads``, ``feedforward_channels``) and the
    architecture switches the arch sets."""
    if isinstance(arch, str):
        if arch.lower() not in arch_zoo:
            raise ValueError(f'unknown arch {arch!r}; valid archs are '
                             f'{sorted(set(arch_zoo))} or a dict')
        return copy.deepcopy(arch_zoo[arch.lower()])
    if not isinstance(arch, dict) or not set(ARCH_ESSENTIALS) <= set(arch):
        raise ValueError(f'a custom arch needs a dict with keys {sorted(ARCH_ESSENTIALS)}, '
                         f'got {arch!r}')
    unknown = sorted(set(arch) - set(ARCH_ESSENTIALS) - set(ARCH_SWITCH_DEFAULTS))
    if unknown:
        raise ValueError(f'unknown key(s) {unknown} in the arch dict; an arch holds '
                         f'{list(ARCH_ESSENTIALS)} and any of {list(ARCH_SWITCH_DEFAULTS)}')
    return copy.deepcopy(dict(arch))


def resolve_switches(arch, arch_settings, given):
    """Each switch: the argument, the arch's value, or the plain-ViT default; an argument
    that contradicts the arch (outside ``OVERRIDABLE_SWITCHES``) is refused."""
    name = repr(arch) if isinstance(arch, str) else 'the arch dict'
    switches = {}
    for key, default in ARCH_SWITCH_DEFAULTS.items():
        value = given[key]
        if key in arch_settings:
            fixed = arch_settings[key]
            if (value is not None and _normalised(value) != _normalised(fixed)
                    and key not in OVERRIDABLE_SWITCHES):
                raise ValueError(
                    f'arch {name} sets {key}={fixed!r}, which defines the models of its '
                    f'checkpoints; got {key}={value!r}. Leave {key} unset, or pass a custom '
                    f'arch dict (e.g. dict(LinearViT.arch_zoo[...], {key}=...))')
            value = fixed if value is None else value
        switches[key] = copy.deepcopy(default if value is None else value)
    check_switches(switches, given, arch_settings)
    return switches


def check_switches(switches, given, arch_settings):
    # patch_size is an int or a pair
    check_option_types('LinearViT', {key: value for key, value in switches.items()
                                      if key != 'patch_size'}, ARCH_SWITCH_DEFAULTS)
    if switches['pos_embed_type'] not in (None, ) + POS_EMBED_TYPES:
        raise ValueError(f"unsupported pos_embed_type {switches['pos_embed_type']!r}; choose "
                         f'from {POS_EMBED_TYPES}')
    if switches['ffn_type'] not in FFN_TYPES:
        raise ValueError(f"unknown ffn_type {switches['ffn_type']!r}; choose from {FFN_TYPES}")
    if switches['ffn_norm'] and switches['ffn_type'] != 'swiglu':
        raise ValueError("ffn_norm (a norm of the hidden features) exists for "
                         "ffn_type='swiglu' only")
    if switches['ffn_type'] == 'swiglu' and (given['act_cfg'] is not None
                                             or 'act_cfg' in arch_settings):
        raise ValueError("act_cfg does not apply to ffn_type='swiglu' (its gate is SiLU); "
                         'leave it unset')
    registers = switches['num_register_tokens']
    if not (isinstance(registers, int) and not isinstance(registers, bool) and registers >= 0):
        raise ValueError(f'num_register_tokens must be an int >= 0, got {registers!r}')
    if not switches['layer_scale_init_value'] >= 0:
        raise ValueError(f"layer_scale_init_value must be >= 0 (0: no LayerScale), got "
                         f"{switches['layer_scale_init_value']}")
    if switches['no_embed_class'] and switches['pos_embed_type'] not in (None, 'learned'):
        raise ValueError(f"no_embed_class concerns a learned position embedding; "
                         f"pos_embed_type is {switches['pos_embed_type']!r}")


def _normalised(value):
    """Lists as tuples, recursively, so a config's ``[16, 16]`` equals an arch's ``(16, 16)``."""
    if isinstance(value, dict):
        return {key: _normalised(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_normalised(item) for item in value)
    return value
