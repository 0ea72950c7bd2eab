"""FSDP's unit of sharding for LinearViT: one block."""
from mmengine.registry import FUNCTIONS
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


@FUNCTIONS.register_module()
def linvit_block_wrap_policy(module, recurse, nonwrapped_numel):
    """FSDP ``auto_wrap_policy``: every :class:`LinearViTLayer` (a ViT block, whatever its
    operator) is one FSDP unit, gathered for its own forward and backward only; the rest
    (embeddings, head, a teacher held elsewhere is never part of it) stays in the root unit.

    In a config: ``strategy=dict(type='FSDPStrategy', model_wrapper=dict(
    auto_wrap_policy=dict(type='linvit_block_wrap_policy')))``.
    """
    from linvit_mm.models.backbones.linear_vit import LinearViTLayer
    return transformer_auto_wrap_policy(module, recurse, nonwrapped_numel,
                                        transformer_layer_cls={LinearViTLayer})
