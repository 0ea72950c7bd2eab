"""LoRA fine-tuning of a LinearViT with mmpretrain's ``LoRAModel``: target checks and merging.

mmpretrain's ``LoRAModel`` (``mmpretrain.models.peft``) wraps a module, replaces the
``nn.Linear`` layers that its ``targets`` name (a full-match regular expression or a name
suffix each) by ``LoRALinear`` (``W0 x + scaling * up(down(x))``), trains only the low-rank
factors and saves only them. Around a LinearViT, as the backbone of an ``ImageClassifier``::

    backbone=dict(type='LoRAModel', module=dict(type='LinearViT', ...), alpha=16, rank=8,
                  targets=[dict(type='attn.qkv'), dict(type='attn.proj')])

Its checkpoints hold the factors and the head, not the frozen weights. Here:
:func:`unmatched_lora_targets` finds the targets that adapted no layer (``LoRAModel`` only
refuses a set of targets of which *none* matched), and :func:`merged_state_dict` folds the
factors into the weights, giving the state dict of the same model without LoRA
(``backbone.layers.N.attn.qkv.weight``), which dense configs load as they load any
classification checkpoint.
"""
import re

import torch

__all__ = ['LORA_TARGETS', 'find_lora_models', 'linear_layer_names', 'merged_state_dict',
           'unmatched_lora_targets']

# The layers of a LinearViT block that LoRA usually adapts, as ``LoRAModel`` targets (name
# suffixes): the attention's input and output projections and the two MLP linears.
LORA_TARGETS = dict(
    qkv=dict(type='attn.qkv'),
    proj=dict(type='attn.proj'),
    ffn_fc1=dict(type='ffn.layers.0.0'),
    ffn_fc2=dict(type='ffn.layers.1'))


def find_lora_models(model):
    """``{key prefix: LoRAModel}`` for every LoRAModel inside ``model`` (itself included)."""
    from mmpretrain.models.peft import LoRAModel
    return {f'{name}.' if name else '': module for name, module in model.named_modules()
            if isinstance(module, LoRAModel)}


def _lora_layers(module):
    from mmpretrain.models.peft.lora import LoRALinear
    return {name: layer for name, layer in module.named_modules()
            if isinstance(layer, LoRALinear)}


def _matches(target_name, module_name):
    # LoRAModel.apply_lora's rule, verbatim.
    return bool(re.fullmatch(target_name, module_name)) or module_name.endswith(target_name)


def linear_layer_names(module):
    """The linear layers LoRA can adapt in ``module`` (adapted ones included), block indices
    folded into ``*``: ``['layers.*.attn.qkv', ...]``."""
    from mmpretrain.models.peft.lora import LoRALinear
    adapted = _lora_layers(module)
    inside = tuple(f'{name}.' for name in adapted)
    names = [name for name, layer in module.named_modules()
             if name in adapted or (isinstance(layer, torch.nn.Linear)
                                    and not name.startswith(inside)
                                    and not isinstance(layer, LoRALinear))]
    folded = []
    for name in names:
        name = re.sub(r'(^|\.)layers\.\d+\.', r'\1layers.*.', name, count=1)
        if name not in folded:
            folded.append(name)
    return folded


def unmatched_lora_targets(lora_model):
    """The targets of ``lora_model`` that adapted no layer: those that match no linear layer
    of its module, or only layers an earlier target already adapted."""
    adapted = list(_lora_layers(lora_model.module))
    unmatched = []
    for position, target in enumerate(lora_model.targets):
        claimed_earlier = [name for name in adapted if any(
            _matches(earlier['type'], name) for earlier in lora_model.targets[:position])]
        if not any(_matches(target['type'], name) for name in adapted
                   if name not in claimed_earlier):
            unmatched.append(target)
    return unmatched


@torch.no_grad()
def _merged_module_state(module):
    """The state dict of ``module`` (holding ``LoRALinear`` layers) as the module without LoRA:
    ``W = W0 + scaling * up @ down`` under each layer's own name."""
    state = module.state_dict()
    for name, layer in _lora_layers(module).items():
        original = layer.original_layer
        delta = layer.lora_up.weight.float() @ layer.lora_down.weight.float() * layer.scaling
        weight = state.pop(f'{name}.original_layer.weight')
        state[f'{name}.weight'] = (weight.float() + delta.to(weight.device)).to(weight.dtype)
        if original.bias is not None:
            state[f'{name}.bias'] = state.pop(f'{name}.original_layer.bias')
        for factor in ('lora_down', 'lora_up'):
            del state[f'{name}.{factor}.weight']
    return state


def merged_state_dict(model):
    """The state dict of ``model`` with every ``LoRAModel`` replaced by its merged module.

    A LoRAModel at ``backbone`` contributes ``backbone.<module key>`` for every tensor of its
    module, with the low-rank factors folded into the adapted layers; the rest of the model
    (the head) is taken as it is. The result loads strictly into the model built without LoRA.
    """
    lora_models = find_lora_models(model)
    if not lora_models:
        raise ValueError(f'{type(model).__name__} holds no LoRAModel: nothing to merge')
    if '' in lora_models:
        return _merged_module_state(lora_models[''].module)
    # LoRAModel's own state-dict hook keeps only the factors of its part; the merged state
    # replaces that part entirely.
    state = {key: value for key, value in model.state_dict().items()
             if not key.startswith(tuple(lora_models))}
    for prefix, lora_model in lora_models.items():
        state.update({prefix + key: value
                      for key, value in _merged_module_state(lora_model.module).items()})
    return state
