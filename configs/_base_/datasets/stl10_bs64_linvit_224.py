# STL-10 (linvit_mm's STL10 dataset): 10 classes, read from data/stl10
# (docs/user_guides/dataset_prepare.md), resized to 224.
_base_ = ['./transfer_bs64_linvit_224.py']

data_root = 'data/stl10'
# The dataset hands over RGB arrays.
data_preprocessor = dict(num_classes=10, to_rgb=False)
train_dataloader = dict(
    dataset=dict(
        type='STL10',
        data_root=data_root,
        split='train',
        pipeline={{_base_.array_train_pipeline}}))
val_dataloader = dict(
    dataset=dict(
        type='STL10',
        data_root=data_root,
        split='test',
        pipeline={{_base_.array_test_pipeline}}))
test_dataloader = val_dataloader
