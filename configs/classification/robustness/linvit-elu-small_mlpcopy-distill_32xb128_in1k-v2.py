# Evaluate the ImageNet-1K model of ../imagenet/linvit-elu-small_mlpcopy-distill_32xb128_in1k.py on ImageNet-V2:
#   tools/test.py THIS_CONFIG work_dirs/linvit-elu-small_mlpcopy-distill_32xb128_in1k/epoch_300.pth
_base_ = [
    '../imagenet/linvit-elu-small_mlpcopy-distill_32xb128_in1k.py',
    '../../_base_/datasets/imagenet_robustness_224.py',
]

test_dataloader = dict(dataset={{_base_.imagenet_v2_dataset}})
test_evaluator = {{_base_.imagenet_v2_evaluator}}
