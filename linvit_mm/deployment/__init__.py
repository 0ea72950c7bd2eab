"""Deployment: ``torch.export`` and ONNX export of LinearViT models, and conversion to timm."""
from .export import (FORMATS, Comparison, ImageModel, check_inputs, compare_with_eager,
                     export_onnx, export_program, program_to_onnx, run_onnx, run_program)
from .patch_grid import PatchGrid
from .to_timm import (ConversionError, build_timm_vit, linvit_to_timm, load_timm_vit,
                      save_timm_vit, timm_spec)

__all__ = ['FORMATS', 'Comparison', 'ConversionError', 'ImageModel', 'PatchGrid',
           'build_timm_vit', 'check_inputs', 'compare_with_eager', 'export_onnx',
           'export_program', 'linvit_to_timm', 'load_timm_vit', 'program_to_onnx', 'run_onnx',
           'run_program', 'save_timm_vit', 'timm_spec']
