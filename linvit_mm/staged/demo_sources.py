"""The shape of the demo's ViTs: ``configs/demo`` as it is (``'vit'``), or every ViT of those
configs reshaped to another source's architecture (``--source dinov2``) and written out."""
import os
import os.path as osp
import pprint

from .recipes import CONFIG_LOCK, DEMO_CONFIGS

# The shape of the demo's teacher (and so of its students, the distillation and alignment
# teachers and the dense stage's ViTs): None keeps configs/demo as it is, a ViT like DeiT's
# (class token, position embedding, patch 8 on 64 px images); otherwise the LinearViT arch
# word whose architecture switches the demo's ViTs take at their own small sizes, and the
# image size the classification pipelines resize to. 'dinov2' has DINOv2's with registers:
# patch 14, 4 register tokens, LayerScale, position slots for the patches only; 112 px keeps
# the default's 8 x 8 grid of patches.
SOURCES = {
    'vit': None,
    'dinov2': dict(arch_word='dinov2-reg-small', img_size=112),
}

# The dense backbones that wrap a LinearViT (their ``vit`` argument).
DENSE_WRAPPERS = tuple(prefix + name for name in ('LinearViTAdapter', 'LinearViTPlainPyramid')
                       for prefix in ('', 'mmpretrain.'))


def source_arch(arch, source):
    """The arch dict of ``source``'s arch word at the sizes of ``arch`` (an arch dict or word
    of LinearViT): the four sizes kept, every architecture switch the source's."""
    from linvit_mm.models.backbones.linear_vit import ARCH_ESSENTIALS, LinearViT
    sizes = LinearViT.resolve_arch(arch)
    shaped = LinearViT.resolve_arch(SOURCES[source]['arch_word'])
    shaped.update({key: sizes[key] for key in ARCH_ESSENTIALS})
    return shaped


def _reshape_vit(vit, source):
    arch = source_arch(dict(vit['arch']) if isinstance(vit['arch'], dict) else vit['arch'],
                       source)
    # An explicit switch of the demo's own ViT (its patch size) gives way to the source's,
    # which LinearViT would otherwise refuse as contradicting the arch.
    for key in set(arch) & set(vit):
        vit.pop(key)
    vit['arch'] = arch
    vit['img_size'] = SOURCES[source]['img_size']


def _resize_classification_pipeline(pipeline, img_size):
    """Crop or resize a classification pipeline's images to ``img_size`` (the generated sets
    are 64 px)."""
    sized = False
    for step in pipeline:
        if step['type'] == 'RandomResizedCrop':
            step['scale'] = img_size
            sized = True
        elif 'Resize' in step['type'] or 'Crop' in step['type']:
            raise ValueError(f'a classification pipeline with {step["type"]} cannot be '
                             f'resized for another source; give it a RandomResizedCrop or '
                             f'no resize')
    if not sized:
        loads = [i for i, step in enumerate(pipeline) if step['type'] == 'LoadImageFromFile']
        if not loads:
            raise ValueError('a classification pipeline without LoadImageFromFile cannot be '
                             'resized for another source')
        pipeline.insert(loads[0] + 1, dict(type='Resize', scale=(img_size, img_size)))


def reshape_for_source(cfg, source):
    """Give every ViT of ``cfg`` (a loaded config of configs/demo) the shape of ``source``: each
    ``LinearViT`` (classifier backbone, distillation or alignment teacher, a LoRA module) and
    the ``vit`` of each ``LinearViTAdapter`` and ``LinearViTPlainPyramid`` take
    ``source_arch`` and the source's image size, and the classification pipelines (those
    ending in ``PackInputs``) resize to it. Returns the dotted paths of the ViTs reshaped; a
    config without one is refused."""
    reshaped = []

    def visit(node, path):
        if isinstance(node, dict):
            kind = node.get('type')
            if kind in ('LinearViT', 'mmpretrain.LinearViT'):
                _reshape_vit(node, source)
                reshaped.append(path)
            elif kind in DENSE_WRAPPERS and 'vit' in node:
                _reshape_vit(node['vit'], source)
                reshaped.append(f'{path}.vit')
            pipeline = node.get('pipeline')
            if (isinstance(pipeline, list) and pipeline
                    and pipeline[-1].get('type') == 'PackInputs'):
                _resize_classification_pipeline(pipeline, SOURCES[source]['img_size'])
            for key, value in node.items():
                visit(value, f'{path}.{key}' if path else key)
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                visit(value, f'{path}[{index}]')

    visit(cfg._cfg_dict, '')
    if not reshaped:
        raise ValueError(f'{cfg.filename} has no LinearViT or dense wrapper of one to give the '
                         f'{source!r} shape')
    return reshaped


class DemoConfigs:
    """The demo's config files for one source: those of configs/demo for ``'vit'``; for
    another source each one reshaped (``reshape_for_source``) and written under
    ``config_dir`` with the same name, rewritten only when its text changes (so that a
    finished stage stays reusable)."""

    def __init__(self, source='vit', config_dir=None):
        if source not in SOURCES:
            raise ValueError(f'unknown source {source!r}; sources: {", ".join(SOURCES)}')
        if SOURCES[source] is not None and config_dir is None:
            raise ValueError(f'the {source!r} source writes its configs: give a config_dir')
        self.source, self.config_dir = source, config_dir

    def path(self, name):
        """The file to run for ``name``, a config of configs/demo."""
        original = osp.join(DEMO_CONFIGS, name)
        if SOURCES[self.source] is None:
            return original
        from mmengine.config import Config
        with CONFIG_LOCK:
            cfg = Config.fromfile(original)
            reshape_for_source(cfg, self.source)
            target = osp.join(self.config_dir, name)
            # Config.pretty_text formats with yapf, seconds a config; the values here are
            # literals, which pprint writes as Python as they are.
            text = ''.join([f'# {name} of configs/demo with its ViTs in the shape of the '
                            f'{self.source!r} source (tools/demo.py --source {self.source})\n'] +
                           [f'{key} = {pprint.pformat(value, width=100, sort_dicts=False)}\n'
                            for key, value in cfg.to_dict().items()])
            if not osp.isfile(target) or open(target).read() != text:
                os.makedirs(self.config_dir, exist_ok=True)
                with open(target + '.tmp', 'w') as f:
                    f.write(text)
                os.replace(target + '.tmp', target)
            return target
