# A short iteration-based version of the paper's recipe (AdamW, warm-up, cosine, clip 3)
# on mmpretrain's default runtime.
_base_ = ['mmpretrain::_base_/default_runtime.py']

optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05, betas=(0.9, 0.999)),
    clip_grad=dict(max_norm=3.0),
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        bias_decay_mult=0.0,
        flat_decay_mult=0.0,
        custom_keys={
            '.cls_token': dict(decay_mult=0.0),
            '.pos_embed': dict(decay_mult=0.0),
            '.block_mixing': dict(decay_mult=0.0),
            # hedgehog's learned feature map starts at the identity; decay would pull it
            # towards a flat map
            '.feature_proj': dict(decay_mult=0.0),
        }))
max_iters = 200
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, end=20),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=False, begin=20, end=max_iters),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict()
test_cfg = dict()
# Checkpoints written atomically, and a NaN or infinite loss stops the run before its
# checkpoint (both from linvit_mm.engine; tools/train.py adds them to configs without them).
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(type='CheckpointHook', interval=max_iters, by_epoch=False,
                    backend_args=dict(backend='atomic_local')),
    check_loss=dict(type='FiniteLossHook'))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
