# ADE20K UperNet 160k (configs/segmentation/README.md): AdamW lr 6e-5 (Tiny: 12e-5), wd 0.01,
# layer-wise lr decay 0.95 over the ViT blocks (BackboneLayerDecayOptimWrapperConstructor
# reads the backbone's get_layer_depth), 1500-iteration linear warm-up then poly decay, 16
# images a batch. No weight decay on position embeddings, the class token, norms, biases or
# the adapter's level embeddings.
_base_ = ['mmseg::_base_/schedules/schedule_160k.py']

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        _delete_=True, type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    constructor='BackboneLayerDecayOptimWrapperConstructor',
    paramwise_cfg=dict(
        layer_decay_rate=0.95,
        norm_decay_mult=0.0,
        bias_decay_mult=0.0,
        custom_keys={
            'level_embed': dict(decay_mult=0.0),
            'pos_embed': dict(decay_mult=0.0),
            'cls_token': dict(decay_mult=0.0),
            'block_mixing': dict(decay_mult=0.0),
            # hedgehog's learned feature map starts at the identity; decay would pull it
            # towards a flat map
            'feature_proj': dict(decay_mult=0.0),
        }))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]
auto_scale_lr = dict(enable=False, base_batch_size=16)
