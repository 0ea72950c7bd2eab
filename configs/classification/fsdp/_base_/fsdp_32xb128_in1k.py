# The ImageNet-1K recipe (../../imagenet/_base_/32xb128_in1k.py) trained with sharded data
# parallelism (FSDP) through mmengine's FlexibleRunner, for models whose student, optimizer
# state and teacher do not fit each GPU under DDP (ViT-L sources and up).
# tools/train.py builds the runner the config names; tools/dist_train.sh starts the
# processes (README.md in this folder). Without CUDA (gloo, CPU processes) tools/train.py
# puts the FSDP wrapper on the CPU.
_base_ = ['../../imagenet/_base_/32xb128_in1k.py']

runner_type = 'FlexibleRunner'
strategy = dict(
    # mmengine's FSDPStrategy, with the optimizer groups of the model before wrapping (its
    # own would see every weight as a flat shard and drop its weight decay)
    type='ParamGroupFSDPStrategy',
    model_wrapper=dict(
        # one FSDP unit per ViT block: each is gathered for its own forward and backward
        auto_wrap_policy=dict(type='linvit_block_wrap_policy'),
        sharding_strategy='FULL_SHARD',
        # the optimizer's parameter groups (no decay on norms, biases, tokens) need the
        # original parameters, not FSDP's flat ones
        use_orig_params=True),
    # rank 0 writes one full checkpoint: what tools/test.py and the dense configs' ViT-Adapter
    # (pretrained=...) read, as from a DDP run
    state_dict_cfg='full')
# Gradient-norm clipping over the whole model, not each rank's shard of it.
optim_wrapper = dict(type='ShardedOptimWrapper')
