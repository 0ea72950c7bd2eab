# Transfer sets (paper Table C): batch 512, 600 epochs with 100 warm-up (Flowers-102,
# Oxford-IIIT Pets).
_base_ = ['./transfer_bs512_adamw_300e_linvit.py']

warmup_epochs = 100
max_epochs = 600
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=warmup_epochs,
         end=max_epochs),
]
train_cfg = dict(max_epochs=max_epochs)
