# Food-101: 101 classes, read from data/food-101, resized to 224
# (docs/user_guides/dataset_prepare.md).
_base_ = ['./transfer_bs64_linvit_224.py']

data_root = 'data/food-101'
data_preprocessor = dict(num_classes=101)
train_dataloader = dict(dataset=dict(type='Food101', data_root=data_root, split='train'))
val_dataloader = dict(dataset=dict(type='Food101', data_root=data_root, split='test'))
test_dataloader = val_dataloader
