# ImageNet-1K for the alignment stages of the staged recipe (*_align-attn_*, *_align-feat_*):
# the training images and augmentation of imagenet_bs128_linvit_224.py; labels are ignored,
# and there is nothing to validate (the aligners predict nothing).
_base_ = ['./imagenet_bs128_linvit_224.py']

val_dataloader = None
val_evaluator = None
test_dataloader = None
test_evaluator = None
