# Demo step 2: transfer the Softmax teacher into a linear ViT on a *different* task: the
# shapes grouped into round / cornered / spiky, from 8 new training images a group
# (setting "mlpcopy-distill"). Every setting trains with the same budget. The operator is relu;
# --cfg-options model.backbone.attn_type=OP picks another.
_base_ = [
    './_base_/linvit-mini.py',
    './_base_/mini_imagenet_64.py',
    './_base_/schedule_runtime_mini.py',
]

data_root = 'data/mini/imagenet_groups'
classes = ['cornered', 'round', 'spiky']
data_preprocessor = dict(num_classes=3)
train_dataloader = dict(batch_size=24, dataset=dict(data_root=data_root, classes=classes))
val_dataloader = dict(dataset=dict(data_root=data_root, classes=classes))
test_dataloader = val_dataloader
model = dict(head=dict(num_classes=3),
             backbone=dict(attn_type='relu', init_cfg=dict(setting='mlpcopy')))
custom_hooks = [{{_base_.distill_hook}}]
