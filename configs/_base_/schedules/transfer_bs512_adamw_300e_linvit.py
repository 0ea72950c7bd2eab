# Transfer sets (paper Table C): batch 512, 300 epochs with 50 warm-up (CIFAR-10/100,
# STL-10, Food-101); the rest of the recipe as on ImageNet.
_base_ = ['./imagenet_bs4096_adamw_300e_linvit.py']

auto_scale_lr = dict(base_batch_size=512)
