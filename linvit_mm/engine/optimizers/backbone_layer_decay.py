"""Layer-wise learning-rate decay for detectors and segmentors with a LinearViT backbone."""
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from mmpretrain.engine.optimizers import LearningRateDecayOptimWrapperConstructor


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class BackboneLayerDecayOptimWrapperConstructor(LearningRateDecayOptimWrapperConstructor):
    """mmpretrain's layer-decay constructor, reading depths from ``model.backbone``.

    mmpretrain's constructor asks the top-level model for ``get_layer_depth``,
    which mmpretrain classifiers have and mmdet detectors / mmseg segmentors do
    not; mmseg's own constructor only knows BEiT/MAE/ConvNeXt parameter names.
    Here every parameter is placed by ``model.backbone.get_layer_depth(name,
    'backbone.')`` (``LinearViT`` and ``LinearViTAdapter`` implement it): backbone
    blocks by depth, everything outside the backbone (neck, heads) at the last
    depth, i.e. with the full learning rate.
    """

    def add_params(self, params, module, prefix='', get_layer_depth=None, **kwargs):
        if get_layer_depth is None and prefix == '':
            backbone = getattr(module, 'backbone', None)
            if backbone is None or not hasattr(backbone, 'get_layer_depth'):
                raise TypeError(f'{type(self).__name__} needs model.backbone.get_layer_depth; '
                                f'{type(module).__name__} has no such backbone')

            def get_layer_depth(name):
                return backbone.get_layer_depth(name, prefix='backbone.')

        super().add_params(params, module, prefix=prefix, get_layer_depth=get_layer_depth,
                           **kwargs)
