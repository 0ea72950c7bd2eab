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

The factors only mean something with the settings and the weights they were trained with:
``scaling = alpha / rank`` multiplies them, and they were fitted to one set of frozen
weights. :func:`lora_record` describes both (``LoRATargetsHook`` writes it into every
checkpoint of a run, ``meta['linvit_mm']['lora']``), and :func:`merge_lora_checkpoint`
refuses to fold a checkpoint into a model whose settings or base weights differ from the
record, or whose tensors (inputs or merged result) are not finite.
"""
import hashlib
import logging
import re

import torch

__all__ = ['LORA_TARGETS', 'find_lora_models', 'linear_layer_names', 'lora_base_digest',
           'lora_record', 'lora_record_differences', 'merge_lora_checkpoint',
           'merged_state_dict', 'unmatched_lora_targets']

_FACTORS = ('lora_down', 'lora_up')

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


def _is_factor(key):
    parts = key.split('.')
    return len(parts) >= 2 and parts[-2] in _FACTORS


def lora_base_digest(lora_model):
    """SHA-256 (hex) of the frozen weights of ``lora_model``'s module: every tensor of its
    state but the low-rank factors, by name, dtype, shape and bytes. Two builds of the same
    config with the same base checkpoint give the same digest; another base does not."""
    digest = hashlib.sha256()
    for name, tensor in sorted(lora_model.module.state_dict().items()):
        if _is_factor(name) or not torch.is_tensor(tensor):
            continue
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f'{name}|{tensor.dtype}|{tuple(tensor.shape)}|'.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _settings(lora_model):
    # plain dicts: a checkpoint holding config objects would not load weights-only
    return dict(alpha=lora_model.alpha, rank=lora_model.rank,
                targets=[dict(target) for target in lora_model.targets])


def lora_record(model, base_digests=None):
    """``{name: {alpha, rank, targets, base_sha256}}`` for every LoRAModel of ``model``
    (``name`` its key prefix without the dot, ``''`` for the model itself). ``base_digests``
    (by the same names) saves hashing the frozen weights again."""
    record = {}
    for prefix, lora_model in find_lora_models(model).items():
        name = prefix.rstrip('.')
        digest = (base_digests or {}).get(name) or lora_base_digest(lora_model)
        record[name] = dict(_settings(lora_model), base_sha256=digest)
    return record


def lora_record_differences(recorded, model):
    """How the LoRA record of a checkpoint (``meta['linvit_mm']['lora']``) and the LoRAModels
    of ``model`` differ, one line each (empty: they agree)."""
    problems = []
    for prefix, lora_model in find_lora_models(model).items():
        name = prefix.rstrip('.')
        label = f'LoRAModel {name or "(the model)"}'
        entry = recorded.get(name)
        if not isinstance(entry, dict):
            problems.append(f'{label}: the checkpoint records no LoRA settings for it '
                            f'(it records {sorted(recorded)})')
            continue
        for field, want in _settings(lora_model).items():
            have = entry.get(field)
            if have != want:
                problems.append(f'{label}: {field} differs: checkpoint {have!r}, config '
                                f'{want!r}')
        digest = lora_base_digest(lora_model)
        if entry.get('base_sha256') != digest:
            base = getattr(lora_model.module, 'init_cfg', None)
            base = f' (loaded by {dict(base)})' if isinstance(base, dict) else ''
            problems.append(
                f'{label}: its base weights{base} are not those the factors were trained on '
                f'(SHA-256 {digest[:16]}..., recorded {str(entry.get("base_sha256"))[:16]}...): '
                f'the config loads another checkpoint than the run did')
    unknown = sorted(set(recorded) - {p.rstrip('.') for p in find_lora_models(model)})
    if unknown:
        problems.append(f'the checkpoint records LoRAModels the config does not have: {unknown}')
    return problems


def _tensor_problems(expected, state):
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = [f'{key}: checkpoint {tuple(state[key].shape)}, model '
                  f'{tuple(expected[key].shape)}' for key in sorted(set(expected) & set(state))
                  if state[key].shape != expected[key].shape]
    problems = []
    if missing:
        problems.append(f'missing: {", ".join(missing)}')
    if unexpected:
        problems.append(f'not in the model: {", ".join(unexpected)}')
    if mismatched:
        problems.append(f'shapes that differ: {"; ".join(mismatched)}')
    return problems


def merge_lora_checkpoint(model, checkpoint, filename, allow_unrecorded=False,
                          logger='current'):
    """Fold the factors of ``checkpoint`` (a LoRA run's, loaded) into ``model``'s weights.

    Args:
        model: the run's model as its config builds it (holding LoRAModels whose modules
            loaded their frozen weights).
        checkpoint (dict): the loaded checkpoint; ``filename`` names it in messages.
        allow_unrecorded (bool): merge a checkpoint that records no LoRA settings (one
            written before runs recorded them), trusting the config's alpha, rank, targets
            and base weights; a WARNING says so. A record that is there is always checked.

    Returns:
        dict: ``state_dict`` (the model without LoRA) and ``meta`` (the checkpoint's, its
        record with stage ``'lora-merged'``, the LoRA settings and ``merged_from``).

    Raises:
        ValueError: every reason the checkpoint does not fit (no record; alpha, rank or
            targets other than the record's; other base weights; missing, extra or
            misshaped tensors), or non-finite values in the checkpoint, the base weights or
            the merged weights, each tensor named. Nothing is merged.
    """
    import os.path as osp

    from mmengine.logging import print_log

    from linvit_mm.transfer.formats import refuse_non_finite
    from .record import RECORD_KEY, checkpoint_record, describe_linear_vit

    lora_models = find_lora_models(model)
    if not lora_models:
        raise ValueError(f'the model of the config ({type(model).__name__}) holds no '
                         f'LoRAModel: nothing to merge')
    state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f'{filename} holds no state dict')
    record = dict(checkpoint_record(checkpoint) or {})
    problems = []
    if isinstance(record.get('lora'), dict):
        problems += lora_record_differences(record['lora'], model)
    elif allow_unrecorded:
        print_log(f'{filename} records neither alpha, rank and targets nor the base weights '
                  f'its factors were trained on: merging with the config\'s, unchecked',
                  logger=logger, level=logging.WARNING)
    else:
        problems.append(
            'it does not record the LoRA settings (alpha, rank, targets) and base weights it '
            'was trained with, so a config with another alpha or base checkpoint cannot be '
            'told apart (runs with LoRATargetsHook record them); to merge it on the config\'s '
            'word, pass --allow-unrecorded (allow_unrecorded=True)')
    problems += _tensor_problems(model.state_dict(), state)
    if problems:
        raise ValueError(f'{filename} does not fit the LoRA model of the config, nothing was '
                         f'merged:\n  - ' + '\n  - '.join(problems))
    refuse_non_finite({k: v for k, v in state.items() if torch.is_tensor(v)}, {}, filename)
    base = {}
    for prefix, lora_model in lora_models.items():
        base.update({prefix + key: value for key, value in lora_model.module.state_dict().items()
                     if not _is_factor(key)})
    refuse_non_finite(base, {}, 'the base weights the config loads')

    model.load_state_dict(state, strict=True)
    merged = merged_state_dict(model)
    try:
        refuse_non_finite(merged, {}, 'the merged weights')
    except ValueError as err:
        raise ValueError(f'{filename}: folding the factors overflows, nothing was written. '
                         f'{err}') from None

    meta = dict(checkpoint.get('meta') or {})
    record.update(
        backbones={prefix: describe_linear_vit(lora_model.module)
                   for prefix, lora_model in lora_models.items()
                   if hasattr(lora_model.module, 'layers')},
        stage='lora-merged',
        lora=lora_record(model),
        merged_from=osp.abspath(filename))
    meta[RECORD_KEY] = record
    return dict(state_dict=merged, meta=meta)
