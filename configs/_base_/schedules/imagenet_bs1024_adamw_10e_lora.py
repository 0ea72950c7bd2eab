# Stage 3 of the staged recipe with LoRA (mmpretrain's LoRAModel around the aligned LinearViT):
# only the low-rank factors and the classification head train.
#
# Where the settings come from: LoLCATs' LoRA recovery (its released configs: rank 8,
# alpha 16, no dropout, on the q/k/v/o projections, i.e. attn.qkv and attn.proj here;
# AdamW with weight decay 0). The lr 1e-3 at batch 1024, 10 epochs with one warm-up epoch and
# cosine to 1e-6 are our choice (LoLCATs trains 2 passes over a small instruction set at
# lr 1e-4; mmpretrain's ViT-B LoRA config trains at 3e-3 for batch 4096, i.e. 7.5e-4 for
# 1024).
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999)),
    clip_grad=dict(max_norm=3.0))

warmup_epochs = 1
max_epochs = 10
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, end=warmup_epochs,
         convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=warmup_epochs,
         end=max_epochs, convert_to_iter_based=True),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
val_cfg = dict()
test_cfg = dict()
auto_scale_lr = dict(base_batch_size=1024)
# LoRATargetsHook: a target that adapts no layer is an error before the run, not a silent
# no-op. StagedRecordHook: the checkpoints record the operators (merge_lora.py keeps it).
custom_hooks = [dict(type='LoRATargetsHook'), dict(type='StagedRecordHook')]
