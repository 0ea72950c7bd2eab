"""Strict loading of the LinearViT inside a dense-prediction wrapper (``LinearViTAdapter``,
``LinearViTPlainPyramid``) from a checkpoint of the classification stage."""
from mmengine.logging import MMLogger
from mmengine.runner.checkpoint import CheckpointLoader

from linvit_mm.utils.checkpoint_state import state_problems

__all__ = ['check_vit_state', 'load_vit_weights']


def check_vit_state(owner, vit_state, prefix, filename):
    """Refuse ``vit_state`` (keys without ``prefix``) unless it fits ``owner.vit`` exactly,
    naming every missing, unexpected and mis-shaped key (``prefix`` included)."""
    vit = owner.vit
    problems = state_problems(vit.state_dict(), vit_state, prefix, vits={'': vit})
    if problems:
        raise ValueError(f'{filename} does not match the ViT of {type(owner).__name__} '
                         f'({vit.attn_type}, {vit.num_layers} blocks, width {vit.embed_dims}): '
                         + ' | '.join(problems))


def load_vit_weights(owner, filename, prefix='backbone.'):
    """Load ``owner.vit`` strictly from the keys under ``prefix`` in ``filename``; see
    ``LinearViTAdapter.load_vit_checkpoint``. ``owner.UNUSED_VIT_KEYS`` matches the ViT keys
    that are skipped (its final norms)."""
    logger = MMLogger.get_current_instance()
    checkpoint = CheckpointLoader.load_checkpoint(filename, map_location='cpu', logger=logger)
    state_dict = checkpoint.get('state_dict', checkpoint)
    vit_state = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    outside = sorted(k for k in state_dict if not k.startswith(prefix))
    if not vit_state:
        raise ValueError(f'{filename} has no keys starting with {prefix!r}; its keys begin '
                         f'with {sorted({k.split(".")[0] for k in state_dict})}')
    vit_keys = set(owner.vit.state_dict())
    unused = sorted(k for k in vit_state if owner.UNUSED_VIT_KEYS.match(k) and k not in vit_keys)
    for key in unused:
        del vit_state[key]
    owner._check_vit_state(vit_state, prefix, filename)
    try:
        owner.vit.load_state_dict(vit_state, strict=True)
    except RuntimeError as err:
        raise ValueError(f'{filename}: the ViT weights under {prefix!r} do not fit '
                         f'the ViT: {err}') from err

    own_keys = [k for k in owner.state_dict() if not k.startswith('vit.')]
    name = type(owner).__name__
    logger.info(f'{name}: loaded {len(vit_state)} ViT tensors from {filename} '
                f'(prefix {prefix!r}).')
    if unused:
        logger.info(f'{name}: skipped the ViT final norm keys, unused in dense '
                    f'prediction: {", ".join(prefix + k for k in unused)}')
    if outside:
        logger.info(f'{name}: ignored {len(outside)} keys outside {prefix!r}: '
                    f'{", ".join(outside)}')
    logger.info(f'{name}: {len(own_keys)} adapter keys keep their own '
                f'initialisation: {", ".join(own_keys)}')
