# Stage 3 of the staged recipe, supervised fine-tuning of the aligned student (all weights):
# the paper's ImageNet recipe (Table B: AdamW, wd 0.05, clip 3.0, cosine to 1e-6, batch 4096)
# shortened to what a model that starts aligned needs: 30 epochs, 5 warm-up epochs and lr
# 5e-4 at batch 4096 are our choice (ViT-AdaLA's third stage is plain supervised
# fine-tuning; its schedule is not one we could reproduce).
_base_ = ['./imagenet_bs4096_adamw_300e_linvit.py']

optim_wrapper = dict(optimizer=dict(lr=5e-4))

warmup_epochs = 5
max_epochs = 30
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=warmup_epochs,
         end=max_epochs),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
