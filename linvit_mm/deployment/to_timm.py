"""LinearViT (or an mmpretrain classifier with one) to timm's ``VisionTransformer``.

:func:`linvit_to_timm` builds a timm ``VisionTransformer`` that computes the same function
(eval mode: dropout and drop-path are not carried) and copies every tensor into it; the
result needs timm, PyTorch and linvit_mm's operator code, not mmpretrain, mmcv or mmengine
configs.

How the LinearViT maps to timm:

* every block's attention is the same linvit_mm operator, as timm's ``attn_layer``
  (:func:`~linvit_mm.deployment.timm_attention.timm_attn_layer`: a subclass of the operator
  with timm's ``forward(x, attn_mask=None, is_causal=False)``), its parameters under the
  same names (``blocks.i.attn.qkv``, ``.proj``, operator extras); LayerScale moves to timm's
  ``ls1`` / ``ls2``; an operator with a position encoding of the block input (``ttt``'s
  conditional position encoding) gets timm's ``Block`` preceded by it as ``block_fn``;
* the patch grid, which timm's blocks do not pass: the model's patch embedding records the
  grid of every image it embeds and the attention layers read it
  (:class:`~linvit_mm.deployment.patch_grid.PatchGrid`, ``model.patch_grid``);
* class token, registers (``reg_token``), learned position embedding (with or without
  class slots, ``no_embed_class``), pre-norm (``norm_pre``), the MLP (GELU or QuickGELU) or
  SwiGLU (timm's ``SwiGLUPacked``, with its sub-LN), final norm or pooled norm (``norm`` /
  ``fc_norm``), class-token or average pooling (``global_pool``), and a linear head;
* a fixed sin-cos position embedding becomes timm's learned one holding the table of the
  model's grid, and RoPE stays inside the operator.

``dynamic_img_size=True`` gives a timm model for any image size; it computes the LinearViT's
function at every size only where timm resamples the position embedding as the LinearViT
does (bicubic with antialias, or no absolute embedding), so other models are refused it.
Without it the model takes the LinearViT's ``img_size``, as timm models do.

The timm model also holds a buffer ``linvit_mm_operator`` (the operator's name as bytes):
a key that a plain ``timm.create_model('vit_*')`` lacks, so a converted file does not load
strictly into a timm model whose attention computes another function (timm's Softmax
``Attention`` has the same ``qkv`` / ``proj`` names as most operators); :func:`load_timm_vit`
builds the right model and checks the name.

Not convertible (refused, naming the reason): hybrids of several operators (timm builds
every block's attention from one class), a neck, heads other than a single linear layer,
outputs of several blocks, ``out_type='featmap'``, a final norm together with a pooled norm.
"""
import functools

import torch
from torch import nn

from ..models.backbones.linear_vit import sincos_pos_embed
from .export import find_linear_vit
from .patch_grid import PatchGrid
from .timm_attention import has_position_encoding, timm_attn_layer

ACTIVATIONS = {'GELU': 'gelu', 'QuickGELU': 'quick_gelu'}
OPERATOR_KEY = 'linvit_mm_operator'


def _operator_code(attn_type):
    return torch.tensor(list(attn_type.encode()), dtype=torch.uint8)


def _operator_name(code):
    return bytes(code.tolist()).decode(errors='replace')


class ConversionError(ValueError):
    """The model has something timm's ``VisionTransformer`` cannot express."""


def _head_linear(model):
    """The classifier's final linear layer (``None`` for a backbone)."""
    if model is find_linear_vit(model):
        return None
    if getattr(model, 'neck', None) is not None:
        raise ConversionError(f'the classifier has a neck ({type(model.neck).__name__}); timm '
                              f'pools the tokens straight into the head')
    head = getattr(model, 'head', None)
    fc = getattr(head, 'fc', None)
    if fc is None and getattr(head, 'hidden_dim', 0) is None:
        fc = head.layers.head                      # VisionTransformerClsHead, no hidden layer
    if not isinstance(fc, nn.Linear):
        raise ConversionError(f'the head {type(head).__name__} is not a single linear layer '
                              f'(LinearClsHead, or VisionTransformerClsHead without hidden_dim)')
    return fc


def _pooling(backbone):
    """timm's ``global_pool``, ``final_norm`` and ``fc_norm`` for the LinearViT's output."""
    if backbone.out_indices != [backbone.num_layers - 1]:
        raise ConversionError(f'out_indices={backbone.out_indices}: timm returns the last '
                              f'block\'s output only ({backbone.num_layers - 1})')
    out_type = backbone.out_type
    if out_type == 'featmap':
        raise ConversionError("out_type='featmap': timm returns tokens; convert with "
                              "out_type='raw' and reshape the patch tokens")
    pooled = getattr(backbone, 'pooled_norm', False)
    if backbone.final_norm and pooled:
        raise ConversionError('a final norm and a pooled norm together: timm has one of the two')
    global_pool = {'cls_token': 'token', 'avg_featmap': 'avg', 'raw': ''}[out_type]
    return dict(global_pool=global_pool, final_norm=backbone.final_norm or pooled,
                fc_norm=pooled)


def _rope_config(backbone):
    rope = getattr(backbone, 'rope', None)
    if rope is None:
        return None
    return dict(type=rope.rope_type, temperature=rope.temperature,
                ref_grid=list(rope.ref_grid) if rope.ref_grid else None)


def timm_spec(model, attn_cfg=None, dynamic_img_size=False):
    """What :func:`build_timm_vit` needs to build the timm model of ``model`` (a LinearViT or
    a classifier with one): plain Python values (a checkpoint can hold them).

    ``attn_cfg``: the operator's keyword arguments the LinearViT was built with (its config's
    ``attn_cfg``); :func:`linvit_to_timm` checks that they build the same operators.
    """
    backbone = find_linear_vit(model)
    attn_types = getattr(backbone, 'attn_types', None) or [backbone.attn_type]
    if len(set(attn_types)) > 1:
        raise ConversionError(f'a hybrid of {sorted(set(attn_types))}: timm builds every block\'s '
                              f'attention from one attn_layer class')
    layer = backbone.layers[0]
    if backbone.ffn_type == 'swiglu':
        mlp, act = 'swiglu', None
        hidden = 2 * backbone.arch_settings['feedforward_channels']   # value and gate halves
    else:
        activation = type(layer.ffn.layers[0][1]).__name__
        if activation not in ACTIVATIONS or getattr(layer.ffn.layers[0][1], 'approximate',
                                                    'none') != 'none':
            raise ConversionError(f'the MLP activation {layer.ffn.layers[0][1]!r}: timm takes '
                                  f'{sorted(ACTIVATIONS)} here')
        mlp, act = 'mlp', ACTIVATIONS[activation]
        hidden = backbone.arch_settings['feedforward_channels']
    pos_embed = backbone.pos_embed_type
    if dynamic_img_size and (pos_embed == 'sincos' or (
            pos_embed == 'learned' and not (backbone.interpolate_mode == 'bicubic'
                                            and backbone.pos_embed_antialias))):
        raise ConversionError(
            f"dynamic_img_size: timm resamples the position embedding of another size bicubic "
            f"with antialias; this model's {pos_embed} embedding "
            + ('is computed for each grid' if pos_embed == 'sincos' else
               f'is resampled {backbone.interpolate_mode!r}, antialias='
               f'{backbone.pos_embed_antialias}') + ', so the models would differ there. '
            'Convert with dynamic_img_size=False (the LinearViT\'s img_size)')
    fc = _head_linear(model)
    embed_dims = backbone.embed_dims
    vit = dict(
        img_size=list(backbone.img_size), patch_size=backbone.patch_size,
        in_chans=backbone.patch_embed.projection.in_channels,
        num_classes=0 if fc is None else fc.out_features, embed_dim=embed_dims,
        depth=backbone.num_layers, num_heads=backbone.num_heads,
        # timm takes int(dim * mlp_ratio) hidden units: half a unit above, so the float
        # product rounds down to the exact count
        mlp_ratio=(hidden + .5) / embed_dims,
        qkv_bias=layer.attn.qkv.bias is not None,
        init_values=1. if isinstance(layer.ffn.gamma2, nn.Module)
        and not isinstance(layer.ffn.gamma2, nn.Identity) else None,
        class_token=backbone.with_cls_token, reg_tokens=backbone.num_register_tokens,
        pos_embed='none' if pos_embed == 'none' else 'learn',
        no_embed_class=backbone.no_embed_class,
        pre_norm=not isinstance(backbone.pre_norm, nn.Identity),
        dynamic_img_size=dynamic_img_size, **_pooling(backbone))
    return dict(vit=vit, attn_type=backbone.attn_type, attn_cfg=dict(attn_cfg or {}),
                rope=_rope_config(backbone), norm_eps=layer.ln1.eps, mlp=mlp, act=act,
                mlp_norm=mlp == 'swiglu' and not isinstance(layer.ffn.norm, nn.Identity))


def build_timm_vit(spec):
    """The timm ``VisionTransformer`` of a :func:`timm_spec` (weights not loaded; the
    attention layers read the grid from ``model.patch_grid``)."""
    from timm.layers import LayerNorm, SwiGLUPacked
    from timm.models.vision_transformer import Block, VisionTransformer
    vit = dict(spec['vit'])
    grid = PatchGrid(int(vit['class_token']) + vit['reg_tokens'])
    attn_type = spec['attn_type']
    extras = dict(norm_layer=functools.partial(LayerNorm, eps=spec['norm_eps']))
    if spec['mlp'] == 'swiglu':
        # the block hands its act_layer to the MLP, over SwiGLUPacked's own SiLU
        extras.update(mlp_layer=SwiGLUPacked, act_layer='silu', scale_mlp_norm=spec['mlp_norm'])
    else:
        extras.update(act_layer=spec['act'])
    if has_position_encoding(attn_type):
        from .timm_block import PositionEncodingBlock
        extras['block_fn'] = PositionEncodingBlock
    else:
        extras['block_fn'] = Block
    model = VisionTransformer(
        **vit, weight_init='skip',
        attn_layer=timm_attn_layer(attn_type, grid, spec['attn_cfg'], spec['rope']), **extras)
    grid.attach(model)
    model.patch_grid = grid
    model.register_buffer(OPERATOR_KEY, _operator_code(attn_type))
    return model


def _key_map(model, backbone, spec, fc):
    """``[(LinearViT name or prefix, timm name or prefix)]``, most specific first."""
    rules = [('patch_embed.projection.', 'patch_embed.proj.'), ('cls_token', 'cls_token'),
             ('register_tokens', 'reg_token'), ('pos_embed', 'pos_embed'),
             ('pre_norm.', 'norm_pre.')]
    vit = spec['vit']
    if backbone.final_norm:
        rules.append(('ln1.', 'norm.'))
    if vit['fc_norm']:
        rules.append(('ln2.', 'fc_norm.'))
    ffn = ([('w12.', 'fc1.'), ('norm.', 'norm.'), ('w3.', 'fc2.')] if spec['mlp'] == 'swiglu'
           else [('layers.0.0.', 'fc1.'), ('layers.1.', 'fc2.')])
    for i in range(backbone.num_layers):
        src, dst = f'layers.{i}.', f'blocks.{i}.'
        rules += [(src + 'ln1.', dst + 'norm1.'), (src + 'ln2.', dst + 'norm2.'),
                  (src + 'attn.gamma1.weight', dst + 'ls1.gamma'), (src + 'attn.', dst + 'attn.'),
                  (src + 'ffn.gamma2.weight', dst + 'ls2.gamma')]
        rules += [(src + 'ffn.' + a, dst + 'mlp.' + b) for a, b in ffn]
    prefix = '' if fc is None else 'backbone.'
    rules = [(prefix + a, b) for a, b in rules]
    if fc is not None:
        head = next(name for name, module in model.named_modules() if module is fc)
        rules.append((head + '.', 'head.'))
    return rules


def _rename(key, rules):
    for src, dst in rules:
        if key == src or (src.endswith('.') and key.startswith(src)):
            return dst + key[len(src):]
    return None


def _check_operators(backbone, model):
    """The converted operators are built like the LinearViT's (same settings and layers)."""
    for i, (layer, block) in enumerate(zip(backbone.layers, model.blocks)):
        source, built = layer.attn, block.attn
        differ = source.extra_repr() != built.extra_repr() or [
            name for name, child in source.named_children()
            if name != 'gamma1' and repr(child) != repr(getattr(built, name, None))]
        if differ:
            raise ConversionError(
                f'block {i}: the operator built for timm is not the LinearViT\'s:\n  '
                f'{source!r}\nbut\n  {built!r}\npass attn_cfg as the LinearViT was built with')


def linvit_to_timm(model, attn_cfg=None, dynamic_img_size=False):
    """``(timm VisionTransformer, spec)`` computing what ``model`` (a LinearViT or an
    mmpretrain classifier with one, in eval mode) computes: the backbone's output
    (``num_classes=0``) or the classifier's logits. ``spec`` rebuilds it
    (:func:`build_timm_vit`) for a saved state dict.

    Every tensor of ``model`` is copied, and every one of the timm model filled; anything
    left over on either side is an error before the model is returned.
    """
    backbone = find_linear_vit(model)
    spec = timm_spec(model, attn_cfg, dynamic_img_size)
    rules = _key_map(model, backbone, spec, _head_linear(model))
    source = model.state_dict()
    timm_model = build_timm_vit(spec)
    _check_operators(backbone, timm_model)
    state, unmapped = {}, []
    for key, value in source.items():
        name = _rename(key, rules)
        (unmapped.append(key) if name is None else state.__setitem__(name, value))
    if unmapped:
        raise ConversionError(f'no place in the timm model for {unmapped}')
    state[OPERATOR_KEY] = _operator_code(spec['attn_type'])
    if backbone.pos_embed_type == 'sincos':
        state['pos_embed'] = sincos_pos_embed(backbone.patch_resolution, backbone.embed_dims,
                                              dtype=torch.float64).to(
                                                  backbone.patch_embed.projection.weight.dtype)
    timm_model.to(backbone.patch_embed.projection.weight.dtype)
    timm_model.load_state_dict(state, strict=True)
    return timm_model.eval(), spec


def save_timm_vit(model, spec, path):
    """Write ``{'state_dict': timm names, 'timm_spec': spec}`` to ``path`` (replaced whole)."""
    import os
    import tempfile
    directory = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(dir=directory, suffix='.tmp', delete=False) as handle:
        torch.save({'state_dict': model.state_dict(), 'timm_spec': spec}, handle)
    os.replace(handle.name, path)


def load_timm_vit(path):
    """The timm model a :func:`save_timm_vit` file holds (weights-only load), in eval mode and
    the saved precision."""
    checkpoint = torch.load(path, map_location='cpu', weights_only=True)
    if not isinstance(checkpoint, dict) or 'timm_spec' not in checkpoint:
        raise ValueError(f'{path} holds no timm_spec: write it with '
                         f'tools/model_converters/linvit_to_timm.py (save_timm_vit)')
    spec, state = checkpoint['timm_spec'], dict(checkpoint['state_dict'])
    # files written before the operator was recorded hold no such key
    recorded = state.setdefault(OPERATOR_KEY, _operator_code(spec['attn_type']))
    if _operator_name(recorded) != spec['attn_type']:
        raise ValueError(f"{path}: its weights record the operator "
                         f"{_operator_name(recorded)!r}, its timm_spec {spec['attn_type']!r}; "
                         f'the file is damaged: convert the model again')
    model = build_timm_vit(spec)
    # in the precision it was saved in
    model.to(state['patch_embed.proj.weight'].dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()
