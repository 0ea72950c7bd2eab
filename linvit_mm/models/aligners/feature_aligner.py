"""Stage 2 of the staged recipe: the whole student matches the teacher's output features."""
import copy

import torch
import torch.nn.functional as F
from mmpretrain.registry import MODELS

from .. import pairing
from ..backbones import LinearViT
from .base_aligner import BaseAligner


@MODELS.register_module()
class FeatureAligner(BaseAligner):
    """Trains the whole student so that its output features match the frozen teacher's.

    Attention alignment fits each block on the teacher's input, so the student's errors add
    up over depth when it runs on its own. Here it runs on its own (ViT-AdaLA's feature
    alignment): both models see the same preprocessed batch and

        ``loss_feat_mse = mse_weight * sum_levels MSE(student, teacher)``
        ``loss_feat_cos = cos_weight * sum_levels mean(1 - cos(student, teacher))``

    over the tokens both have (cosine per token across channels); a loss whose weight is 0
    is not computed. Levels: ``features='final'`` (default) the final normed tokens (the
    last block's output after the final norm); ``features='out_indices'`` the outputs of the
    student config's ``out_indices`` blocks, the levels a ViT-Adapter consumes (normed where
    it is the last block and the model has a final norm). Both models are built with
    ``out_type='raw'`` and the same ``out_indices`` and ``final_norm``; their configs may not
    set other values.

    The student loads its weights through its own ``init_cfg``, typically the attention
    alignment's checkpoint (``dict(type='LinearViTCheckpoint', checkpoint=...)``). Every
    student parameter trains (as its config leaves it: ``frozen_stages`` applies). Labels are
    ignored.

    Args:
        backbone (dict): the student LinearViT config.
        teacher (dict): the Softmax teacher LinearViT config, with an ``init_cfg`` that loads
            its weights.
        features (str): ``'final'`` or ``'out_indices'``.
        mse_weight (float): weight of the MSE loss, finite and >= 0. Defaults to 1.
        cos_weight (float): weight of the cosine loss, finite and >= 0. Defaults to 0.
        patch_tokens_only, data_preprocessor, init_cfg: see :class:`BaseAligner`.
    """

    FEATURES = ('final', 'out_indices')
    STAGE = 'align-feat'

    def __init__(self, backbone, teacher, features='final', mse_weight=1.0, cos_weight=0.0,
                 patch_tokens_only=None, data_preprocessor=None, init_cfg=None):
        if features not in self.FEATURES:
            raise ValueError(f'features must be one of {self.FEATURES}, got {features!r}')
        self.features = features
        self.mse_weight = pairing.check_loss_weight(mse_weight, 'mse_weight')
        self.cos_weight = pairing.check_loss_weight(cos_weight, 'cos_weight')
        if not (self.mse_weight or self.cos_weight):
            raise ValueError('mse_weight and cos_weight are both 0: nothing would be aligned')
        backbone = self._student_cfg(backbone, features)
        super().__init__(backbone, teacher, patch_tokens_only=patch_tokens_only,
                         data_preprocessor=data_preprocessor, init_cfg=init_cfg)

    @staticmethod
    def _student_cfg(cfg, features):
        if not isinstance(cfg, dict):
            raise TypeError(f'backbone must be a LinearViT config dict, got {cfg!r}')
        cfg = copy.deepcopy(dict(cfg))
        if cfg.get('out_type', 'raw') != 'raw':
            raise ValueError(f"FeatureAligner compares tokens: the student is built with "
                             f"out_type='raw'; its config sets out_type={cfg['out_type']!r}")
        cfg['out_type'] = 'raw'
        if features == 'final':
            given = cfg.get('out_indices', -1)
            if given not in (-1, [-1], (-1, )):
                raise ValueError(f"features='final' aligns the final normed tokens, but the "
                                 f"student config sets out_indices={given!r}: use "
                                 f"features='out_indices' to align those levels, or leave "
                                 f'out_indices unset')
            cfg['out_indices'] = -1
        return cfg

    def teacher_cfg_for(self, cfg, student):
        if not isinstance(cfg, dict):
            raise TypeError(f'teacher must be a LinearViT config dict, got {cfg!r}')
        cfg = copy.deepcopy(dict(cfg))
        wanted = dict(out_type='raw', out_indices=list(student.out_indices),
                      final_norm=student.final_norm)
        conflicts = []
        for key, value in wanted.items():
            given = cfg.get(key)
            if key == 'out_indices' and given is not None:
                given = [given] if isinstance(given, int) else list(given)
                given = [i % len(student.layers) for i in given]
            if given is not None and given != value:
                conflicts.append(f'{key}={cfg[key]!r} (the student needs {value!r})')
        if conflicts:
            raise ValueError(f"the teacher is read at the student's levels; its config sets "
                             f"{', '.join(conflicts)}: leave them unset")
        try:
            depth = LinearViT.resolve_arch(cfg.get('arch', 'small'))['num_layers']
        except (ValueError, KeyError):
            depth = None  # the build reports the arch
        if depth != len(student.layers):
            # Levels of another depth do not exist; the pair check names the mismatch.
            wanted.pop('out_indices')
        cfg.update(wanted)
        return cfg

    def staged_record(self):
        return dict(stage=self.STAGE, features=self.features)

    # ------------------------------------------------------------------ forward
    def level_pairs(self, images):
        """``[(student tokens, teacher tokens), ...]`` per level, tokens both compare."""
        with torch.no_grad():
            target = self.teacher(images)
        return [self.comparable(s, t) for s, t in zip(self.backbone(images), target)]

    def loss(self, inputs):
        losses = {}
        pairs = self.level_pairs(inputs)
        if self.mse_weight:
            losses['loss_feat_mse'] = self.mse_weight * sum(
                F.mse_loss(s.float(), t.float()) for s, t in pairs)
        if self.cos_weight:
            losses['loss_feat_cos'] = self.cos_weight * sum(
                (1 - F.cosine_similarity(s.float(), t.float(), dim=-1)).mean() for s, t in pairs)
        return losses

    def extract(self, inputs):
        return self.backbone(inputs)
