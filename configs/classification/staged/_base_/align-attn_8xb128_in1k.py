# Staged recipe, stage 1, what every size and operator shares: attention alignment. Each
# block's attention alone trains, on the teacher's input to that block, against the teacher's
# attention output; no labels. A leaf inherits a Softmax base (softmax-{size}.py) beside this
# file and sets the student's arch and operator and the teacher.
_base_ = [
    '../../../_base_/models/linvit/linvit-classifier.py',
    '../../../_base_/datasets/imagenet_bs128_linvit_224_align.py',
    '../../../_base_/schedules/imagenet_bs1024_adamw_5e_align-attn.py',
    'mmpretrain::_base_/default_runtime.py',
]

model = dict(
    _delete_=True,
    type='AttentionAligner',
    backbone=dict(type='LinearViT', img_size=224),
    loss_weight=1.0)
