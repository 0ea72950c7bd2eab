# CIFAR-10: 10 classes, read from data/cifar10, resized to 224
# (docs/user_guides/dataset_prepare.md).
_base_ = ['./transfer_bs64_linvit_224.py']

data_root = 'data/cifar10'
# The dataset hands over RGB arrays (download=False: fail clearly if the data is missing).
data_preprocessor = dict(num_classes=10, to_rgb=False)
train_dataloader = dict(
    dataset=dict(
        type='CIFAR10',
        data_root=data_root,
        split='train',
        download=False,
        pipeline={{_base_.array_train_pipeline}}))
val_dataloader = dict(
    dataset=dict(
        type='CIFAR10',
        data_root=data_root,
        split='test',
        download=False,
        pipeline={{_base_.array_test_pipeline}}))
test_dataloader = val_dataloader
