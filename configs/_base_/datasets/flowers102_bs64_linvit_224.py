# Flowers-102: 102 classes, read from data/flowers102 (docs/user_guides/dataset_prepare.md),
# resized to 224.
_base_ = ['./transfer_bs64_linvit_224.py']

data_root = 'data/flowers102'
data_preprocessor = dict(num_classes=102)
train_dataloader = dict(dataset=dict(type='Flowers102', data_root=data_root, split='trainval'))
val_dataloader = dict(dataset=dict(type='Flowers102', data_root=data_root, split='test'))
test_dataloader = val_dataloader
