"""``SoftmaxTransfer``: the initialisation settings as an mmengine weight initialiser.

Usage in a config (``custom_imports=dict(imports=['linvit_mm.models',
'linvit_mm.transfer'])`` registers it)::

    backbone=dict(type='LinearViT', arch='tiny', attn_type='relu',
                  init_cfg=dict(type='SoftmaxTransfer', checkpoint=DEIT, setting='mlpcopy'))
    head=dict(type='VisionTransformerClsHead', num_classes=10, in_channels=192,
              init_cfg=[dict(type='Constant', layer='Linear', val=0),
                        dict(type='SoftmaxTransfer', checkpoint=DEIT, setting='fullcopy',
                             prefix='head.')])

``LinearViT.init_weights`` runs its default initialisation before ``init_cfg``, so the
copies are not overwritten. Like mmengine's ``Pretrained`` the checkpoint is read when
the initialiser is called (at ``model.init_weights()``), not when it is built; unlike it,
only local files are read, and never by a plain unpickler (see
:func:`load_softmax_checkpoint`).
"""
from mmengine.model.weight_init import update_init_info
from mmengine.registry import WEIGHT_INITIALIZERS

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

    After a call the module carries the report as ``module.transfer_report``.
    """

    def __init__(self, checkpoint=None, setting=None, components=None, prefix='backbone.',
                 map_location='cpu', fc_norm_target='ln2', analytic_cfg=None):
        self.setting, self.components, self.analytic = resolve_setting(setting, components)
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
        # mmengine's initialize() sets this on every initialiser; this one acts on the module
        # as a whole either way.
        self.wholemodule = False

    def __call__(self, module):
        report = transfer_softmax_weights(
            module, self.checkpoint,
            setting=self.setting,
            components=None if self.setting is not None else list(self.components),
            prefix=self.prefix, logger='current', analytic_cfg=self.analytic_cfg,
            map_location=self.map_location, fc_norm_target=self.fc_norm_target)
        module.transfer_report = report
        if hasattr(module, '_params_init_info'):
            update_init_info(module, init_info=self._get_init_info())

    def _get_init_info(self):
        what = self.setting if self.setting is not None else f'components {list(self.components)}'
        source = f' from {self.checkpoint}' if self.checkpoint is not None else ''
        return f'{self.__class__.__name__}: {what}{source}'
