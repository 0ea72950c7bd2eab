"""Deployment: ``torch.export`` and ONNX export of LinearViT models, and conversion to timm."""
from .export import (FORMATS, Comparison, ImageModel, check_inputs, compare_with_eager,
                     export_onnx, export_program, run_onnx, run_program)

__all__ = ['FORMATS', 'Comparison', 'ImageModel', 'check_inputs', 'compare_with_eager',
           'export_onnx', 'export_program', 'run_onnx', 'run_program']
