from .backbone_layer_decay import BackboneLayerDecayOptimWrapperConstructor

__all__ = ['BackboneLayerDecayOptimWrapperConstructor']
