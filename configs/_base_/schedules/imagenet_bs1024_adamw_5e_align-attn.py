# Stage 1 of the staged recipe, attention alignment (AttentionAligner): only each block's
# attention trains, on the teacher's input to it, against the teacher's attention output.
#
# Where the settings come from:
# - AdamW with no weight decay: LoLCATs' attention transfer (its released configs: AdamW,
#   weight decay 0; lr 1e-2 there for feature maps alone). Here qkv and proj train as well,
#   from the teacher's values, so we chose a lower lr, 1e-3 at batch 1024 (our choice).
# - 5 epochs, 1 warm-up epoch, cosine to 1e-6: our choice. LoLCATs aligns on a few tens of
#   millions of tokens (two passes over a small instruction set); 5 ImageNet epochs are
#   ~1.25e9 patch tokens, ample for a per-block regression. ViT-AdaLA states the stage, not a
#   schedule we could reproduce.
# - No gradient clipping: a clip by the global norm would couple the blocks, so a job that
#   aligns some blocks (layers=[...]) would no longer give the weights of the full job.
# - StagedRecordHook: the checkpoints record the operators and the trained blocks, which the
#   next stage's loader and tools/model_converters/merge_aligned_blocks.py read.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999)))

warmup_epochs = 1
max_epochs = 5
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
