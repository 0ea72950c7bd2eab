"""A student, its Softmax teacher and their config, loaded for the analysis tools.

**Student**: a config's ``model`` with the config's top-level ``data_preprocessor``, weights
from a checkpoint loaded strictly. The compared module inside it is the distillation hook's
``student`` (default ``backbone``), see :func:`backbone_of`.

**Teacher**: the ``teacher`` of the config's ``AttentionDistillHook``, initialised from its
own ``init_cfg`` as the hook does, or another config's ``model``; its weights may come from a
file instead (:func:`build_teacher`).
"""
from mmengine.config import Config

__all__ = ['DISTILL_HOOK', 'backbone_of', 'backbone_state_from', 'build_model',
           'build_teacher', 'find_distill_hook', 'load_config', 'load_student',
           'load_teacher_weights']

DISTILL_HOOK = 'AttentionDistillHook'


def load_config(path, options=None):
    """The config at ``path``, ``options`` (``--cfg-options``) merged, its
    ``custom_imports`` imported."""
    from mmengine.utils import import_modules_from_strings
    cfg = Config.fromfile(path)
    if options:
        cfg.merge_from_dict(options)
    if cfg.get('custom_imports'):
        import_modules_from_strings(**cfg['custom_imports'])
    return cfg


def find_distill_hook(cfg):
    """The config's AttentionDistillHook entry (a dict), or None."""
    for hook in cfg.get('custom_hooks') or []:
        hook_type = hook.get('type')
        name = hook_type if isinstance(hook_type, str) else getattr(hook_type, '__name__', '')
        if name.split('.')[-1] == DISTILL_HOOK:
            return hook
    return None


def build_model(model_cfg):
    """An mmpretrain model (classifier or backbone) of a config dict."""
    from mmengine.registry import DefaultScope
    from mmpretrain.registry import MODELS
    with DefaultScope.overwrite_default_scope('mmpretrain'):
        return MODELS.build(model_cfg)


def load_student(cfg, checkpoint, device):
    """The config's model with the checkpoint's weights, in eval mode on ``device``.

    Raises:
        ValueError: the checkpoint does not fit the model (names or shapes).
    """
    from mmengine.runner import load_checkpoint
    model_cfg = cfg.model.copy()
    if cfg.get('data_preprocessor') is not None:
        # what the Runner does: the top-level preprocessor (mean, std) joins the model
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    model = build_model(model_cfg)
    # strict: comparing a partly random student with its teacher would mislead silently
    try:
        load_checkpoint(model, checkpoint, map_location='cpu', strict=True, logger='current')
    except RuntimeError as err:
        raise ValueError(f'{checkpoint} does not fit the model of the config: {err}') from None
    return model.to(device).eval()


def backbone_of(model, path='backbone'):
    """The LinearViT inside a model (``path``) or the model itself."""
    if hasattr(model, 'layers'):
        return model
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f'{type(model).__name__} has no module {path!r} with ViT blocks '
                         f'(.layers)') from None
    if not hasattr(module, 'layers'):
        raise ValueError(f'{path!r} ({type(module).__name__}) has no ViT blocks (.layers); '
                         f'the tool compares LinearViT backbones')
    return module


def backbone_state_from(raw, backbone, source):
    """Tensors for ``backbone`` from a loaded checkpoint: its own state dict, a run
    checkpoint of a classifier (``backbone.*``), or a Softmax ViT layout that
    ``linvit_mm.transfer`` reads (DeiT, timm, ...).

    Raises:
        ValueError: a tensor of the backbone has no counterpart (``source`` names the file).
    """
    expected = backbone.state_dict()
    state = raw.get('state_dict', raw) if isinstance(raw, dict) else raw
    if set(expected) <= set(state):
        picked = state
    elif any(key.startswith('backbone.') for key in state):
        picked = {k[len('backbone.'):]: v for k, v in state.items() if k.startswith('backbone.')}
    else:
        from linvit_mm.transfer.checkpoint import load_softmax_checkpoint
        mapped = load_softmax_checkpoint(raw).state_dict
        picked = {k[len('backbone.'):]: v for k, v in mapped.items() if k.startswith('backbone.')}
    picked = {k: v for k, v in picked.items() if k in expected}
    missing = sorted(set(expected) - set(picked))
    if missing:
        raise ValueError(f'{source}: no weights for the teacher\'s {", ".join(missing[:8])}'
                         f'{" ..." if len(missing) > 8 else ""} ({len(missing)} of '
                         f'{len(expected)} tensors missing)')
    return picked


def load_teacher_weights(backbone, checkpoint):
    """Load ``checkpoint`` (any layout of :func:`backbone_state_from`) into ``backbone``
    strictly."""
    from linvit_mm.utils import load_checkpoint_file
    raw = load_checkpoint_file(checkpoint, map_location='cpu')
    state = backbone_state_from(raw, backbone, checkpoint)
    try:
        backbone.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f'{checkpoint}: the weights do not fit the teacher: {err}') from None


def build_teacher(student_cfg, teacher_config=None, teacher_checkpoint=None, device='cpu'):
    """The teacher backbone, in eval mode on ``device``, and where it came from (a phrase
    for the report).

    Args:
        student_cfg (Config): the student's config; its AttentionDistillHook names the
            teacher unless ``teacher_config`` is given.
        teacher_config (str, optional): a config whose ``model`` is the teacher (a
            classifier or a bare backbone).
        teacher_checkpoint (str, optional): the teacher's weights instead of its
            ``init_cfg``.

    Raises:
        ValueError: no teacher is named, or the weights do not fit it.
    """
    if teacher_config is not None:
        teacher_cfg = load_config(teacher_config).model
        source = f'model of {teacher_config}'
    else:
        hook = find_distill_hook(student_cfg)
        if hook is None:
            raise ValueError('the config has no AttentionDistillHook in custom_hooks to take '
                             'the teacher from; give --teacher-config (and '
                             '--teacher-checkpoint)')
        teacher_cfg = hook['teacher']
        source = f'{DISTILL_HOOK} teacher of the config'
    teacher = build_model(teacher_cfg)
    if teacher_checkpoint is not None:
        load_teacher_weights(backbone_of(teacher), teacher_checkpoint)
        source += f', weights from {teacher_checkpoint}'
    else:
        teacher.init_weights()  # its init_cfg loads the checkpoint, as in the hook
        init_cfg = teacher_cfg.get('init_cfg') or teacher_cfg.get('backbone', {}).get('init_cfg')
        source += f', initialised by {dict(init_cfg) if init_cfg else "its default init"}'
    teacher = teacher.to(device).eval()
    return backbone_of(teacher), source
