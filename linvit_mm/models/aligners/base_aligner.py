"""What the two alignment stages share: a student LinearViT and a frozen Softmax teacher."""
import copy
import os.path as osp
from abc import abstractmethod

from mmengine.model import BaseModel
from mmpretrain.registry import MODELS
from torch import nn

from .. import pairing
from ..backbones import LinearViT


class _DetachedTeacher:
    """Holds the teacher outside the student's module tree.

    So the teacher is never in ``state_dict`` (checkpoints), ``parameters()`` (the optimizer)
    or DDP's synchronisation; deep copies of the model (mmengine's EMA) share this one
    teacher instead of copying it.
    """

    def __init__(self, module):
        self.module = module

    def __deepcopy__(self, memo):
        return self


class BaseAligner(BaseModel):
    """A student LinearViT (``backbone``) trained to match a frozen Softmax teacher; no labels.

    The teacher is built from its config (a ``LinearViT`` with ``attn_type='softmax'`` and an
    ``init_cfg`` that loads its weights), initialised by :meth:`init_weights`, always in eval
    mode and without gradients, and moved with the model (``.to`` / ``.cuda``). It is not a
    sub-module: it never reaches a checkpoint, the optimizer or an EMA copy, and a run resumed
    from a checkpoint rebuilds it from the config.

    Student and teacher must have the same depth, width, head counts and patch size, and the
    student either the teacher's extra tokens (class token, registers) or none. Tokens are
    compared where both models have them: every token when the sequences match (unless
    ``patch_tokens_only``), the patch tokens when the student has no extra tokens. The rules
    are :mod:`linvit_mm.models.pairing`'s.

    Args:
        backbone (dict): config of the student LinearViT.
        teacher (dict): config of the Softmax teacher LinearViT.
        patch_tokens_only (bool, optional): compare patch tokens only. Forced on when the
            student has no extra tokens.
        data_preprocessor (dict, optional): the teacher's preprocessing, a
            ``ClsDataPreprocessor`` (labels pass through and are ignored) that normalises:
            one without ``mean`` / ``std`` is refused, since the teacher never saw raw 0-255
            pixels (``mean=[0, 0, 0], std=[1, 1, 1]`` aligns on raw pixels deliberately).
            Without one, the model still computes its losses on given tensors, but its
            ``train_step`` / ``val_step`` / ``test_step``, the Runner's path, refuse to run:
            the Runner fills it from a top-level ``data_preprocessor``, and a stage config that
            replaces ``model`` with ``_delete_=True`` drops one kept inside the base's model.
        init_cfg (dict, optional): of the aligner itself; the student's and the teacher's are
            in their configs.
    """

    def __init__(self, backbone, teacher, patch_tokens_only=None, data_preprocessor=None,
                 init_cfg=None):
        given = data_preprocessor is not None
        if not isinstance(data_preprocessor, nn.Module):
            # Built from mmpretrain's registry, as ImageClassifier does, so that the type
            # resolves whatever the default scope.
            data_preprocessor = MODELS.build(
                dict(dict(type='ClsDataPreprocessor'), **(data_preprocessor or {})))
        if given and getattr(data_preprocessor, '_enable_normalize', None) is False:
            raise ValueError(
                f'{type(self).__name__}: the data_preprocessor normalises nothing (no mean / '
                f'std), so student and teacher would see raw 0-255 pixels, which the teacher '
                f'never saw in its training. {self.PREPROCESSING_ADVICE}; to align on raw '
                f'pixels deliberately, set mean=[0, 0, 0] and std=[1, 1, 1]')
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        self.preprocessing_given = given
        # checked before anything is built
        pairing.patch_tokens_only(None, None, patch_tokens_only)
        self.backbone = self._build_vit(backbone, 'backbone (the student)')
        teacher = self._build_vit(self.teacher_cfg_for(teacher, self.backbone), 'teacher')
        teacher.requires_grad_(False)
        teacher.eval()
        self._teacher = _DetachedTeacher(teacher)
        self._check_pair(self.backbone, teacher)
        self.student_extra = self.backbone.num_extra_tokens
        self.teacher_extra = teacher.num_extra_tokens
        student_layout, teacher_layout = (pairing.token_layout(vit)
                                          for vit in (self.backbone, teacher))
        # The student sees the teacher's sequence, or its patch tokens when it has no extras.
        self.patch_input = student_layout != teacher_layout
        self.patch_tokens_only = pairing.patch_tokens_only(student_layout, teacher_layout,
                                                           patch_tokens_only)

    PREPROCESSING_ADVICE = (
        "Give the teacher's preprocessing, e.g. data_preprocessor=dict(mean=[123.675, "
        "116.28, 103.53], std=[58.395, 57.12, 57.375], to_rgb=True) at the top level of the "
        "config or in `model` (a stage config that replaces the model with _delete_=True "
        "drops a data_preprocessor kept inside the base's model)")

    def _check_preprocessing(self):
        if not self.preprocessing_given:
            raise ValueError(
                f'{type(self).__name__} was built without a data_preprocessor, so it would '
                f'align on raw 0-255 pixels, which the teacher never saw in its training. '
                f'{self.PREPROCESSING_ADVICE}')

    def train_step(self, data, optim_wrapper):
        self._check_preprocessing()
        return super().train_step(data, optim_wrapper)

    def val_step(self, data):
        self._check_preprocessing()
        return super().val_step(data)

    def test_step(self, data):
        self._check_preprocessing()
        return super().test_step(data)

    @property
    def teacher(self):
        """The frozen teacher (not a sub-module)."""
        return self._teacher.module

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _build_vit(cfg, role):
        if not isinstance(cfg, dict) or 'type' not in cfg:
            raise TypeError(f'{role} must be a LinearViT config dict with a type, got {cfg!r}')
        vit = MODELS.build(copy.deepcopy(cfg))
        if not isinstance(vit, LinearViT):
            raise TypeError(f'{role} must be a LinearViT, got {type(vit).__name__}')
        return vit

    def teacher_cfg_for(self, cfg, student):
        """The teacher config to build, given the built student (as given, here)."""
        return cfg

    @staticmethod
    def _check_pair(student, teacher):
        """Refuse a pair that cannot be aligned, naming every mismatch."""
        pairing.refuse(
            pairing.fit_problems(student, teacher)
            + pairing.input_token_problems(pairing.token_layout(student),
                                           pairing.token_layout(teacher)),
            'the student and teacher cannot be aligned')

    # ------------------------------------------------------------------ module plumbing
    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half() reach sub-modules through _apply; the teacher is not one.
        super()._apply(fn, *args, **kwargs)
        self.teacher._apply(fn, *args, **kwargs)
        return self

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()
        return self

    def init_weights(self):
        """The teacher's ``init_cfg`` (its Softmax weights), then the student's."""
        self.check_teacher_preprocessing()
        self.teacher.init_weights()
        super().init_weights()

    def check_teacher_preprocessing(self):
        """Refuse preprocessing that differs from what the teacher's checkpoint records.

        Checkpoints of ``tools/train.py`` runs record the mean, std and channel order their
        model normalised its inputs with (``meta['linvit_mm']['preprocessing']``); releases
        and older runs record none, and nothing is compared then.
        """
        from linvit_mm.engine.strict_load import describe_preprocessing
        from linvit_mm.staged import checkpoint_record
        from linvit_mm.utils.checkpoint import load_checkpoint_file
        init_cfgs = self.teacher.init_cfg
        init_cfgs = init_cfgs if isinstance(init_cfgs, (list, tuple)) else [init_cfgs]
        paths = [cfg.get('checkpoint') for cfg in init_cfgs if isinstance(cfg, dict)]
        ours = describe_preprocessing(self.data_preprocessor) if self.preprocessing_given \
            else None
        for path in paths:
            if ours is None or not isinstance(path, str) or not osp.isfile(path):
                continue
            record = checkpoint_record(load_checkpoint_file(path, map_location='cpu')) or {}
            theirs = record.get('preprocessing')
            if not isinstance(theirs, dict):
                continue
            differing = [f'{key}: teacher {theirs.get(key)!r}, this stage {ours[key]!r}'
                         for key in ('mean', 'std', 'to_rgb') if theirs.get(key) != ours[key]]
            if differing:
                raise ValueError(
                    f"{type(self).__name__}: the data_preprocessor differs from the one the "
                    f"teacher's checkpoint {path} was trained with ({'; '.join(differing)}): "
                    f'student and teacher would be aligned on inputs the teacher never saw. '
                    f"Give the stage the teacher's preprocessing")

    # ------------------------------------------------------------------ tokens
    def comparable(self, student_tokens, teacher_tokens):
        """Student and teacher ``(B, N, C)`` tokens restricted to those both compare."""
        return pairing.align_tokens(student_tokens, teacher_tokens,
                                    teacher_tokens.shape[1] - self.teacher_extra,
                                    self.patch_tokens_only)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        """``mode='loss'``: the alignment losses; ``'tensor'``: what the student produces.

        There are no predictions: the stage trains without labels, so runs have no
        validation (``val_cfg = val_dataloader = val_evaluator = None``).
        """
        if mode == 'loss':
            return self.loss(inputs)
        if mode == 'tensor':
            return self.extract(inputs)
        raise ValueError(f'{type(self).__name__} has no mode {mode!r}: it trains without '
                         f"labels and predicts nothing ('loss' and 'tensor' only); run it "
                         f'without validation (val_cfg, val_dataloader and val_evaluator None)')

    @abstractmethod
    def loss(self, inputs):
        """The loss dict of one batch of preprocessed images."""

    @abstractmethod
    def extract(self, inputs):
        """The student's tokens that the loss compares."""

    @abstractmethod
    def staged_record(self):
        """The stage entries of the checkpoint record (``StagedRecordHook``)."""
