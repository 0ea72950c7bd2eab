# COCO Mask R-CNN 1x (configs/detection/README.md): AdamW lr 1e-4, wd 0.05 (Tiny: 2e-4,
# 0.01), 12 epochs, steps at 8 and 11, 500-iteration warm-up, 16 images a batch. No weight
# decay on position embeddings, the class token, norms, biases or the adapter's level
# embeddings.
_base_ = ['mmdet::_base_/schedules/schedule_1x.py']

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        _delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(
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
auto_scale_lr = dict(base_batch_size=16)
