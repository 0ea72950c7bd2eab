# CIFAR-100: 100 classes, read from data/cifar100 (docs/user_guides/dataset_prepare.md), resized
# to 224.
_base_ = ['./transfer_bs64_linvit_224.py']

data_root = 'data/cifar100'
# The dataset hands over RGB arrays (download=False: fail clearly if the data is missing).
data_preprocessor = dict(num_classes=100, to_rgb=False)
train_dataloader = dict(
    dataset=dict(
        type='CIFAR100',
        data_root=data_root,
        split='train',
        download=False,
        pipeline={{_base_.array_train_pipeline}}))
val_dataloader = dict(
    dataset=dict(
        type='CIFAR100',
        data_root=data_root,
        split='test',
        download=False,
        pipeline={{_base_.array_test_pipeline}}))
test_dataloader = val_dataloader
