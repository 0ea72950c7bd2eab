# Stage 2 of the staged recipe, feature alignment (FeatureAligner): the whole student, run on
# its own, matches the frozen teacher's final features, which corrects the errors that
# block-wise alignment lets accumulate over depth (ViT-AdaLA's second stage).
#
# Where the settings come from: AdamW (betas, weight decay 0.05, clip 3.0, no decay on norms,
# biases, class token and position embeddings) as the paper's ImageNet recipe (Table B); the
# lr 2e-4 at batch 1024 (a fine-tuning rate: the student starts aligned), 10 epochs with one
# warm-up epoch and cosine to 1e-6 are our choice (ViT-AdaLA states the stage, not a schedule
# we could reproduce).
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=0.05, betas=(0.9, 0.999)),
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

warmup_epochs = 1
max_epochs = 10
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=warmup_epochs,
         end=max_epochs, convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs)
val_cfg = None
test_cfg = None
auto_scale_lr = dict(base_batch_size=1024)
custom_hooks = [dict(type='StagedRecordHook')]
