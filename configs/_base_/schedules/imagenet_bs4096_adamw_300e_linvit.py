# Paper Table B: AdamW, lr 2e-3 at batch 4096, wd 0.05, betas (0.9, 0.999), gradient clip
# 3.0, 50 warm-up epochs, cosine to 1e-6, 300 epochs. No weight decay on norms, biases,
# the class token, position embeddings or MHLA's block-mixing matrix.
_base_ = ['mmpretrain::_base_/schedules/imagenet_bs1024_adamw_swin.py']

optim_wrapper = dict(
    optimizer=dict(lr=2e-3, weight_decay=0.05, betas=(0.9, 0.999)),
    clip_grad=dict(max_norm=3.0),
    paramwise_cfg=dict(
        custom_keys={
            '.cls_token': dict(decay_mult=0.0),
            '.pos_embed': dict(decay_mult=0.0),
            '.block_mixing': dict(decay_mult=0.0),
            # hedgehog's learned feature map starts at the identity; decay would pull it
            # towards a flat map
            '.feature_proj': dict(decay_mult=0.0),
        }))

warmup_epochs = 50
max_epochs = 300
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=warmup_epochs,
         end=max_epochs),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
auto_scale_lr = dict(base_batch_size=4096)
