_base_ = [
    '../../_base_/models/linvit/linvit-small.py',
    '../imagenet/_base_/32xb128_in1k.py',
    '../../_base_/datasets/imagenet_robustness_224.py',
]

model = dict(backbone=dict(attn_type='relu'))
test_dataloader = dict(dataset={{_base_.imagenet_a_dataset}})
test_evaluator = {{_base_.imagenet_a_evaluator}}
