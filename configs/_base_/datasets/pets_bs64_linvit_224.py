# Oxford-IIIT Pets: 37 classes, read from data/oxford-iiit-pet
# (docs/user_guides/dataset_prepare.md), resized to 224.
_base_ = ['./transfer_bs64_linvit_224.py']

data_root = 'data/oxford-iiit-pet'
data_preprocessor = dict(num_classes=37)
train_dataloader = dict(dataset=dict(type='OxfordIIITPet', data_root=data_root, split='trainval'))
val_dataloader = dict(dataset=dict(type='OxfordIIITPet', data_root=data_root, split='test'))
test_dataloader = val_dataloader
