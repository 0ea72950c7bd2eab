# A tiny attention-alignment run (stage 1 of the staged recipe) on the generated mini ImageNet
# set, for the tests. The tests set data_root and the teacher's checkpoint
# (linvit_mm.testing.staged.write_softmax_teacher).
_base_ = ['./tiny_cls_mini.py']

custom_imports = dict(imports=['linvit_mm.models', 'linvit_mm.engine'],
                      allow_failed_imports=False)

arch = dict(embed_dims=32, num_layers=3, num_heads=2, feedforward_channels=64)
teacher_checkpoint = 'teacher.pth'
model = dict(
    _delete_=True,
    type='AttentionAligner',
    backbone=dict(type='LinearViT', arch=arch, attn_type='relu', img_size=32, patch_size=8),
    teacher=dict(
        type='LinearViT',
        arch=arch,
        attn_type='softmax',
        img_size=32,
        patch_size=8,
        init_cfg=dict(type='Pretrained', checkpoint=teacher_checkpoint, prefix='backbone.')))

optim_wrapper = dict(optimizer=dict(type='AdamW', lr=3e-3, weight_decay=0.0))
val_dataloader = None
val_evaluator = None
val_cfg = None
test_dataloader = None
test_evaluator = None
test_cfg = None
train_cfg = dict(type='IterBasedTrainLoop', max_iters=4)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=4, by_epoch=False))
custom_hooks = [dict(type='StagedRecordHook')]
