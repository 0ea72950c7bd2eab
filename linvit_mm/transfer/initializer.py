"""``SoftmaxTransfer``: the initialisation settings as an mmengine weight initialiser.

Usage in a config (``custom_imports=dict(imports=['linvit_mm.models',
'linvit_mm.transfer'])`` registers it)::

    backbone=dict(type='LinearViT', arch='tiny', attn_type='relu',
                  init_cfg=dict(type='SoftmaxTransfer', checkpoint=DEIT, setting='mlpcopy'))
    head=dict(type='VisionTransformerClsHead', num_classes=10, in_channels=192,
              init_cfg=[dict(type='Constant', layer='Linear', val=0),
                        dict(type='SoftmaxTransfer', checkpoint=DEIT, setting='fullcopy',
                             prefix='head.')])

Nothing overwrites the copies: ``LinearViT`` runs its default initialisation at
construction, not in ``init_weights``; and mmengine's ``BaseModule.init_weights`` applies a
module's ``init_cfg`` *before* its children's ``init_weights`` (only ``Pretrained`` runs
after them), so a child with an ``init_cfg`` of its own (a block given one through
``layer_cfgs``) would overwrite them. ``SoftmaxTransfer`` therefore runs the children's
``init_weights`` itself before it copies (mmengine then skips them: they are initialised).
Initialisers listed *after* it in the same ``init_cfg`` still run after it, as listed.

Like ``Pretrained`` the checkpoint is read when the initialiser is called (at
``model.init_weights()``), not when it is built; unlike it, only local files are read, and
never by a plain unpickler (see :func:`load_softmax_checkpoint`).
"""
from mmengine.model import is_model_wrapper
from mmengine.model.weight_init import update_init_info
from mmengine.registry import WEIGHT_INITIALIZERS

from .families import FAMILIES, known_families_text
from .inference import check_num_heads
from .settings import resolve_setting
from .transfer import transfer_softmax_weights

__all__ = ['SoftmaxTransferInit']


@WEIGHT_INITIALIZERS.register_module(name='SoftmaxTransfer')
class SoftmaxTransferInit:
    """Initialise a module with one setting of the paper (Table A) from a Softmax ViT.

    Args:
        checkpoint (str, optional): a Softmax ViT checkpoint file of any layout
            :func:`load_softmax_checkpoint` reads. May be None only for ``random``,
            ``mimetic`` and ``impulse``.
        setting (str, optional): ``random``, ``mimetic``, ``impulse``, ``copy``,
            ``mlpcopy`` or ``fullcopy``.
        components (list[str], optional): instead of ``setting``, the components to copy.
        prefix (str): ``'backbone.'`` for the backbone, ``'head.'`` for the head.
        map_location (str): where tensors are loaded. Defaults to ``'cpu'``.
        fc_norm_target (str): where a global-pool ``fc_norm`` goes, see
            :func:`load_softmax_checkpoint`.
        analytic_cfg (dict, optional): Mimetic / Impulse constants to override.
        num_heads (int, optional): the checkpoint's number of attention heads, for
            checkpoints that do not state it; see :func:`transfer_softmax_weights`.
        allow_partial (bool): copy components the checkpoint holds only in part instead of
            refusing; see :func:`transfer_softmax_weights`.
        family (str, optional): the checkpoint's source family, for one whose tensors do not
            tell it; see :func:`load_softmax_checkpoint`.

    After a call the module carries the report as ``module.transfer_report``.
    """

    def __init__(self, checkpoint=None, setting=None, components=None, prefix='backbone.',
                 map_location='cpu', fc_norm_target='ln2', analytic_cfg=None, num_heads=None,
                 allow_partial=False, family=None):
        self.setting, self.components, self.analytic = resolve_setting(setting, components)
        if num_heads is not None:
            check_num_heads(num_heads, None)
        if family is not None and family not in FAMILIES:
            raise ValueError(f'SoftmaxTransfer: unknown source family {family!r}; known '
                             f'families are: {known_families_text()}')
        if checkpoint is None and self.components:
            what = (f'setting {setting!r}' if setting is not None
                    else f'components {list(self.components)}')
            raise ValueError(f'SoftmaxTransfer: {what} copies from a Softmax checkpoint; '
                             f'checkpoint may be None only for random, mimetic and impulse')
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.map_location = map_location
        self.fc_norm_target = fc_norm_target
        self.analytic_cfg = analytic_cfg
        self.num_heads = num_heads
        self.allow_partial = allow_partial
        self.family = family
        # mmengine's initialize() sets this on every initialiser; this one acts on the module
        # as a whole either way.
        self.wholemodule = False

    def __call__(self, module):
        init_children_first(module)
        report = transfer_softmax_weights(
            module, self.checkpoint,
            setting=self.setting,
            components=None if self.setting is not None else list(self.components),
            prefix=self.prefix, logger='current', analytic_cfg=self.analytic_cfg,
            map_location=self.map_location, fc_norm_target=self.fc_norm_target,
            num_heads=self.num_heads, allow_partial=self.allow_partial, family=self.family)
        module.transfer_report = report
        if hasattr(module, '_params_init_info'):
            update_init_info(module, init_info=self._get_init_info())

    def _get_init_info(self):
        what = self.setting if self.setting is not None else f'components {list(self.components)}'
        source = f' from {self.checkpoint}' if self.checkpoint is not None else ''
        return f'{self.__class__.__name__}: {what}{source}'


def init_children_first(module):
    """Run the children's ``init_weights`` now, as ``BaseModule.init_weights`` would next.

    Written out because mmengine offers no way to order an initialiser after the children
    but hard-codes that for ``Pretrained``; the loop is mmengine's own, and a child it has
    run is marked initialised, so mmengine does not run it again.
    """
    for child in module.children():
        if is_model_wrapper(child) and not hasattr(child, 'init_weights'):
            child = child.module
        if hasattr(child, 'init_weights') and not getattr(child, 'is_init', False):
            child.init_weights()
            if hasattr(child, '_params_init_info'):
                update_init_info(child, init_info=f'Initialized by user-defined `init_weights` '
                                                  f'in {child.__class__.__name__} ')
