"""LinearViT's arch words and the families they come from, as plain data.

The one place for what defines each pre-trained family (its switches: patch size, LayerScale,
registers, position embedding, RoPE, MLP, norms) and its head count at each released width.
``LinearViT.arch_zoo`` is built from it (:mod:`linvit_mm.models.backbones.arch_settings`), and
the transfer's source families (:mod:`linvit_mm.transfer.families`) read it, so an arch word
and a checkpoint's family cannot disagree on heads, RoPE, registers or MLP.
"""

# The four sizes every arch holds.
ARCH_ESSENTIALS = ('embed_dims', 'num_layers', 'num_heads', 'feedforward_channels')

# The architecture switches an arch can set besides its sizes, with the value a plain
# DeiT-shaped ViT has. ``None`` for ``pos_embed_type``: the operator's convention.
ARCH_SWITCH_DEFAULTS = dict(
    patch_size=16,
    qkv_bias=True,
    layer_scale_init_value=0.,
    num_register_tokens=0,
    pos_embed_type=None,
    no_embed_class=False,
    pos_embed_antialias=False,
    rope=None,
    ffn_type='mlp',
    act_cfg=dict(type='GELU'),
    ffn_norm=False,
    pre_norm=False,
    norm_cfg=dict(type='LN', eps=1e-6),
    final_norm=True,
    pooled_norm=False,
)

# Switches a model may set differently from its arch word: how features are read out (the
# ViT-Adapter drops the final norm) or resampled, not what a checkpoint's tensors compute.
OVERRIDABLE_SWITCHES = ('final_norm', 'pooled_norm', 'pos_embed_antialias')

FFN_TYPES = ('mlp', 'swiglu')

# The Softmax families a checkpoint can come from (timm's model definitions; see
# docs/user_guides/foundation_sources.md), in the order a checkpoint's family is inferred: the
# first whose
# ``recognised_by`` properties its tensors show with the values ``switches`` imply.
#   description: what it is, for messages;
#   heads: {embed_dims: num_heads} of its released models (64-channel heads, except DINOv3's
#       7B); copying attention into a model with another count is refused;
#   switches: the architecture switches of its models (the rest: ARCH_SWITCH_DEFAULTS);
#       the RoPE type, which no tensor shows, is ``switches['rope']['type']``;
#   variants: switches of a named variant on top of ``switches`` (arch words name it);
#   recognised_by: fields of ``linvit_mm.transfer.families.Architecture``.
FAMILIES = {
    'dinov3': dict(
        description='DINOv3 (LayerScale, registers, 2-D RoPE, no absolute position embedding)',
        heads={384: 6, 768: 12, 1024: 16, 1280: 20, 4096: 32},
        switches=dict(patch_size=16, qkv_bias=False, layer_scale_init_value=1e-5,
                      num_register_tokens=4, pos_embed_type='none',
                      rope=dict(type='dinov3', temperature=100.),
                      norm_cfg=dict(type='LN', eps=1e-5)),
        recognised_by=('layer_scale', 'num_register_tokens', 'pos_embed')),
    'deit3': dict(
        description='DeiT III (LayerScale, a position embedding without class-token slot)',
        heads={192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16},
        switches=dict(patch_size=16, layer_scale_init_value=1e-6, pos_embed_type='learned',
                      no_embed_class=True, pos_embed_antialias=True),
        recognised_by=('layer_scale', 'num_register_tokens', 'pos_embed',
                       'pos_embed_extra_tokens')),
    'dinov2': dict(
        description='DINOv2 with or without registers (LayerScale, patch 14)',
        heads={384: 6, 768: 12, 1024: 16, 1536: 24},
        switches=dict(patch_size=14, layer_scale_init_value=1e-5, pos_embed_type='learned',
                      pos_embed_antialias=True),
        variants=dict(reg=dict(num_register_tokens=4, no_embed_class=True)),
        recognised_by=('layer_scale', 'pos_embed')),
    'eva02': dict(
        description='EVA-02 (SwiGLU MLP, 2-D RoPE, query/value biases)',
        heads={192: 3, 384: 6, 768: 12, 1024: 16},
        switches=dict(patch_size=14, ffn_type='swiglu', pos_embed_type='learned',
                      pos_embed_antialias=True,
                      rope=dict(type='eva', temperature=10000., ref_grid=(16, 16)),
                      final_norm=False, pooled_norm=True),
        recognised_by=('ffn_type', 'layer_scale')),
    'clip': dict(
        description='CLIP / OpenCLIP image tower (a norm before the blocks)',
        heads={768: 12, 1024: 16, 1280: 16},
        switches=dict(patch_size=16, pre_norm=True, act_cfg=dict(type='mmpretrain.QuickGELU'),
                      norm_cfg=dict(type='LN', eps=1e-5), pos_embed_type='learned',
                      pos_embed_antialias=True),
        # OpenCLIP / timm vit_base_patch16_clip_224: the same tensors, trained with GELU
        variants=dict(gelu=dict(act_cfg=dict(type='GELU'))),
        recognised_by=('pre_norm', 'layer_scale', 'ffn_type')),
    'vit': dict(
        description='plain ViT: DeiT, DINO, MoCo v3, iBOT, MAE, timm vit_* (none of the above)',
        heads={},
        switches={},
        recognised_by=('layer_scale', 'num_register_tokens', 'ffn_type', 'pre_norm')),
}

# The released linear ViTs (linvit_mm.transfer.linear_releases converts them), in the same
# form. ViT^3 (LeapLabTHU/ViTTT, attn_type='ttt') has no class token and no position
# embedding besides each block's cpe; its tiny has 6 heads at width 192, not DeiT-T's 3.
# InLine-DeiT (LeapLabTHU/InLine, attn_type='inline'): DeiT's layout at other widths, head
# dim 32. The MHLA ViTs (DAGroup-PKU/MHLA, attn_type='mhla' with its official switches):
# DeiT's sizes, no qkv bias, a learned embedding without a class token, no final norm and a
# norm of the pooled tokens (timm's fc_norm).
LINEAR_FAMILIES = {
    'vit3': dict(heads={192: 6, 384: 6, 768: 12}, switches=dict(pos_embed_type='none')),
    'inline-deit': dict(heads={192: 6, 320: 10, 384: 12}, switches={}),
    'mhla': dict(heads={192: 3, 384: 6, 768: 12},
                 switches=dict(qkv_bias=False, pos_embed_type='learned', final_norm=False,
                               pooled_norm=True)),
}

# Every arch word: its sizes, and for a word of a family (``family``, optionally one of its
# ``variant``s) that family's switches and its head count at the word's width; any other
# key is a switch of the word's own.
ARCH_WORDS = {
    # DeiT (sizes only): MLP ratio 4, depth 12
    'tiny': dict(embed_dims=192, num_layers=12, num_heads=3, feedforward_channels=768),
    'small': dict(embed_dims=384, num_layers=12, num_heads=6, feedforward_channels=1536),
    'base': dict(embed_dims=768, num_layers=12, num_heads=12, feedforward_channels=3072),
    'dinov2-small': dict(family='dinov2', embed_dims=384, num_layers=12,
                         feedforward_channels=1536),
    'dinov2-base': dict(family='dinov2', embed_dims=768, num_layers=12,
                        feedforward_channels=3072),
    'dinov2-large': dict(family='dinov2', embed_dims=1024, num_layers=24,
                         feedforward_channels=4096),
    'dinov2-reg-small': dict(family='dinov2', variant='reg', embed_dims=384, num_layers=12,
                             feedforward_channels=1536),
    'dinov2-reg-base': dict(family='dinov2', variant='reg', embed_dims=768, num_layers=12,
                            feedforward_channels=3072),
    'dinov2-reg-large': dict(family='dinov2', variant='reg', embed_dims=1024, num_layers=24,
                             feedforward_channels=4096),
    'dinov3-small': dict(family='dinov3', embed_dims=384, num_layers=12,
                         feedforward_channels=1536),
    'dinov3-base': dict(family='dinov3', embed_dims=768, num_layers=12,
                        feedforward_channels=3072),
    'dinov3-large': dict(family='dinov3', embed_dims=1024, num_layers=24,
                         feedforward_channels=4096),
    'deit3-small': dict(family='deit3', embed_dims=384, num_layers=12,
                        feedforward_channels=1536),
    'deit3-base': dict(family='deit3', embed_dims=768, num_layers=12, feedforward_channels=3072),
    'clip-base': dict(family='clip', embed_dims=768, num_layers=12, feedforward_channels=3072),
    'clip-base-gelu': dict(family='clip', variant='gelu', embed_dims=768, num_layers=12,
                           feedforward_channels=3072),
    # EVA-02's MLP ratio is 4 * 2/3: int(C * 8/3) hidden units per SwiGLU half.
    'eva02-tiny': dict(family='eva02', embed_dims=192, num_layers=12, feedforward_channels=512),
    'eva02-small': dict(family='eva02', embed_dims=384, num_layers=12,
                        feedforward_channels=1024),
    'eva02-base': dict(family='eva02', embed_dims=768, num_layers=12, feedforward_channels=2048,
                       ffn_norm=True),
    'vit3-tiny': dict(family='vit3', embed_dims=192, num_layers=12, feedforward_channels=768),
    'vit3-small': dict(family='vit3', embed_dims=384, num_layers=12, feedforward_channels=1536),
    'vit3-base': dict(family='vit3', embed_dims=768, num_layers=12, feedforward_channels=3072),
    'inline-deit-tiny': dict(family='inline-deit', embed_dims=192, num_layers=12,
                             feedforward_channels=768),
    'inline-deit-small': dict(family='inline-deit', embed_dims=320, num_layers=12,
                              feedforward_channels=1280),
    'inline-deit-base': dict(family='inline-deit', embed_dims=384, num_layers=12,
                             feedforward_channels=1536),
    'mhla-tiny': dict(family='mhla', embed_dims=192, num_layers=12, feedforward_channels=768),
    'mhla-small': dict(family='mhla', embed_dims=384, num_layers=12, feedforward_channels=1536),
    'mhla-base': dict(family='mhla', embed_dims=768, num_layers=12, feedforward_channels=3072),
}

# Other names of arch words.
ARCH_ALIASES = {'t': 'tiny', 'deit-tiny': 'tiny', 's': 'small', 'deit-small': 'small',
                'b': 'base', 'deit-base': 'base'}
