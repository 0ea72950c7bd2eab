# Staged recipe, stage 2, what every size and operator shares: feature alignment. The whole
# student, loaded from its stage-1 checkpoint, matches the frozen teacher's final normed
# tokens (MSE); no labels. A leaf inherits a Softmax base (softmax-{size}.py) beside this
# file and sets the student's arch, operator and checkpoint and the teacher.
_base_ = [
    '../../../_base_/models/linvit/linvit-classifier.py',
    '../../../_base_/datasets/imagenet_bs128_linvit_224_align.py',
    '../../../_base_/schedules/imagenet_bs1024_adamw_10e_align-feat.py',
    'mmpretrain::_base_/default_runtime.py',
]

model = dict(
    _delete_=True,
    type='FeatureAligner',
    backbone=dict(type='LinearViT', img_size=224, init_cfg=dict(type='LinearViTCheckpoint')),
    mse_weight=1.0,
    cos_weight=0.0)
