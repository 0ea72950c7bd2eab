# Demo step 2, what every setting shares: transfer the Softmax teacher into a linear ViT on a
# *different* task, the shapes grouped into round / cornered / spiky, from 8 new training
# images a group, with the same budget for every setting. The operator is relu;
# --cfg-options model.backbone.attn_type=OP picks another. The leaves set the setting and,
# for "-distill", the hook.
_base_ = [
    './linvit-mini.py',
    './mini_imagenet_64.py',
    './schedule_runtime_mini.py',
]

data_root = 'data/mini/imagenet_groups'
classes = ['cornered', 'round', 'spiky']
data_preprocessor = dict(num_classes=3)
train_dataloader = dict(batch_size=24, dataset=dict(data_root=data_root, classes=classes))
val_dataloader = dict(dataset=dict(data_root=data_root, classes=classes))
test_dataloader = val_dataloader
model = dict(backbone=dict(attn_type='relu'), head=dict(num_classes=3))
