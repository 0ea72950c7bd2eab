"""The rules that pair a linear-attention student with its Softmax teacher.

One home for what the distillation hook (``AttentionDistillHook``), the alignment stages
(``AttentionAligner``, ``FeatureAligner``) and the hybrid-block selection ask of a
student-teacher pair:

* **fit** (:func:`fit_problems`): the same depth; in every compared block the same width
  (``embed_dims``) and head count; the same patch size; a Softmax teacher (unless allowed);
  a teacher that loads weights (an ``init_cfg``); attention maps on the teacher for map
  targets. Every mismatch is one line, so one error names them all (:func:`refuse`).
* **blocks** (:func:`resolve_layers`): which blocks are compared. By default the linear ones
  (a hybrid's Softmax blocks already run the teacher's operator); ``layers`` given: those,
  negative ones counting from the end, each block once, inside the model.
* **tokens** (:func:`token_layout`, :func:`patch_tokens_only`, :func:`align_tokens`): every
  token is compared when student and teacher lead their sequences with the same extra tokens
  (class token, registers); otherwise, or when asked, the patch tokens alone, the last
  ``H*W`` of each sequence, so a teacher's class token or register is never matched with a
  student's patch or with an extra token of another kind. A student that runs on the
  teacher's own sequence (block-wise alignment) needs the teacher's extra tokens or none
  (:func:`input_token_problems`).
* **loss weights** (:func:`check_loss_weight`): finite numbers, >= 0 or > 0.

The functions take models (a LinearViT, or any module holding linvit_mm attention operators)
and read what they need from them; nothing is built or loaded here.
"""
import math
import numbers
from collections import namedtuple

from mmengine.utils import to_2tuple

from ..utils.blocks import block_index_list
from .attention import BaseAttention, attention_class

__all__ = ['TokenLayout', 'align_tokens', 'attention_modules', 'check_loss_weight',
           'fit_problems', 'input_token_problems', 'linear_blocks', 'mapless_operators',
           'non_softmax_operators', 'patch_size_of', 'patch_tokens_only', 'refuse',
           'resolve_layers', 'softmax_blocks', 'token_layout']


# ------------------------------------------------------------------ operators and blocks
def attention_modules(model):
    """The linvit_mm attention operators of ``model``, one per block, in block order."""
    return [module for module in model.modules() if isinstance(module, BaseAttention)]


def _is_softmax(attn):
    # isinstance, not the name: a subclass of the Softmax operator computes Softmax attention
    return isinstance(attn, attention_class('softmax'))


def softmax_blocks(attn_modules):
    """Indices of the blocks whose operator is Softmax."""
    return [index for index, attn in enumerate(attn_modules) if _is_softmax(attn)]


def linear_blocks(attn_modules):
    """Indices of the blocks whose operator is not Softmax (the teacher's)."""
    return [index for index, attn in enumerate(attn_modules) if not _is_softmax(attn)]


def non_softmax_operators(attn_modules):
    """The sorted names of the operators among ``attn_modules`` that are not Softmax."""
    return sorted({attn.attn_type for attn in attn_modules if not _is_softmax(attn)})


def mapless_operators(attn_modules):
    """The sorted names of the operators among ``attn_modules`` without an attention map."""
    return sorted({attn.attn_type for attn in attn_modules if not attn.has_map})


def _block_ranges(indices):
    from linvit_mm.staged.record import block_ranges
    return block_ranges(indices)


def resolve_layers(attn_modules, layers=None, verb='distil', all_softmax='every'):
    """The blocks to compare, and the Softmax blocks left out by default.

    Args:
        attn_modules (list): the student's attention operators, one per block.
        layers (Sequence[int], optional): the blocks asked for; negative ones count from the
            end. None: every linear block; a student that is Softmax throughout gives every
            block (``all_softmax='every'``) or is refused (``'refuse'``).
        verb (str): what the blocks are chosen for (``'distil'``, ``'align'``), in errors.
        all_softmax (str): ``'every'`` or ``'refuse'``, see ``layers``.

    Returns:
        tuple: ``(blocks, skipped)``, both sorted lists of indices in ``[0, depth)``;
        ``skipped`` holds the Softmax blocks of a hybrid left out by default (empty when
        ``layers`` is given).

    Raises:
        TypeError: ``layers`` is not a list of ints.
        ValueError: ``layers`` is empty, names a block outside the student or one block
            twice (``[0, 0]``, or ``[11, -1]`` in 12 blocks); no linear block to compare
            and ``all_softmax='refuse'``.
    """
    if all_softmax not in ('every', 'refuse'):
        raise ValueError(f"all_softmax must be 'every' or 'refuse', got {all_softmax!r}")
    num_blocks = len(attn_modules)
    layers = block_index_list(layers, verb)
    if layers is None:
        linear, softmax = linear_blocks(attn_modules), softmax_blocks(attn_modules)
        if linear:
            return linear, softmax
        if all_softmax == 'refuse':
            raise ValueError(f"the student has no linear-attention block to {verb} (all its "
                             f"blocks are Softmax, the teacher's operator)")
        return list(range(num_blocks)), []
    outside = [i for i in layers if not -num_blocks <= i < num_blocks]
    if outside:
        raise ValueError(f'layers {outside} are outside the {num_blocks} blocks of the student; '
                         f'use indices in [{-num_blocks}, {num_blocks - 1}]')
    blocks = [i % num_blocks for i in layers]
    twice = sorted({block for block in blocks if blocks.count(block) > 1})
    if twice:
        # as attn_type refuses them: a block listed twice is compared once, not twice
        raise ValueError(f'layers {layers} name block(s) {twice} more than once (negative '
                         f'indices count from the end of the {num_blocks} blocks); list each '
                         f'block once')
    return sorted(blocks), []


# ------------------------------------------------------------------ fit
def patch_size_of(model):
    """The patch size ``(h, w)`` of the first (outermost) module of ``model`` that declares
    one (``patch_size`` not None), else None."""
    for module in model.modules():
        size = getattr(module, 'patch_size', None)
        if size is not None:
            return to_2tuple(size)
    return None


def _loads_weights(teacher):
    """Whether the teacher, or a LinearViT inside it, has an ``init_cfg`` to load."""
    from .backbones import LinearViT
    return any(getattr(module, 'init_cfg', None) is not None for module in teacher.modules()
               if module is teacher or isinstance(module, LinearViT))


def _per_block(trait, what, student_attn, teacher_attn, blocks):
    groups = {}
    for index in blocks:
        have, want = getattr(student_attn[index], trait), getattr(teacher_attn[index], trait)
        if have != want:
            groups.setdefault((have, want), []).append(index)
    if not groups:
        return []
    differ = '; '.join(f'block{"s" if len(group) > 1 else ""} {_block_ranges(group)}: '
                       f'{have} vs {want}' for (have, want), group in groups.items())
    return [f"the teacher's {what} ({trait}) differs from the student's (student vs teacher: "
            f"{differ}); build the teacher with the student's arch"]


def fit_problems(student, teacher, blocks=None, allow_non_softmax=False,
                 non_softmax_advice="set its attn_type='softmax'", target='output',
                 require_weights=True):
    """Why ``teacher`` cannot be compared with ``student`` block for block, one line each.

    Args:
        student, teacher (nn.Module): LinearViTs, or modules holding linvit_mm attention
            operators (one per block).
        blocks (list[int], optional): the compared blocks, whose width and head count must
            match; default every block.
        allow_non_softmax (bool): accept a teacher whose operators are not Softmax.
        non_softmax_advice (str): what the line about a non-Softmax teacher advises.
        target (str): ``'map'`` also needs an attention map in the teacher's operators.
        require_weights (bool): a teacher without an ``init_cfg`` would keep random weights.

    Returns:
        list[str]: empty when the pair fits.
    """
    student_attn, teacher_attn = attention_modules(student), attention_modules(teacher)
    problems = []
    if len(student_attn) != len(teacher_attn):
        problems.append(f'the student has {len(student_attn)} blocks, the teacher '
                        f'{len(teacher_attn)}: they are compared block for block, so build '
                        f"the teacher with the student's arch")
    non_softmax = non_softmax_operators(teacher_attn)
    if non_softmax and not allow_non_softmax:
        problems.append(f"the teacher's attention is {non_softmax}, not Softmax: "
                        f'{non_softmax_advice}')
    mapless = mapless_operators(teacher_attn) if target == 'map' else []
    if mapless:
        problems.append(f"target='map' needs attention maps, which the {mapless} operator(s) "
                        f"of the teacher do not have; use target='output' or a teacher whose "
                        f'operator has a map')
    if require_weights and not _loads_weights(teacher):
        problems.append('the teacher has no init_cfg, so it would keep random weights: give it '
                        "one that loads the Softmax checkpoint (e.g. dict(type='SoftmaxTransfer', "
                        "checkpoint=..., setting='fullcopy'))")
    depth = min(len(student_attn), len(teacher_attn))
    blocks = range(depth) if blocks is None else [i for i in blocks if i < depth]
    for trait, what in (('embed_dims', 'width'), ('num_heads', 'head count')):
        problems += _per_block(trait, what, student_attn, teacher_attn, blocks)
    patches = patch_size_of(student), patch_size_of(teacher)
    if None not in patches and patches[0] != patches[1]:
        cut = ['x'.join(map(str, size)) for size in patches]
        problems.append(f'the student cuts {cut[0]}-pixel patches, the teacher {cut[1]}-pixel '
                        f'patches, so their tokens do not correspond; set the teacher\'s '
                        f"patch_size to the student's")
    return problems


def refuse(problems, header):
    """Raise ``ValueError(header + every problem)`` if there is any."""
    if problems:
        raise ValueError(f'{header}:\n  - ' + '\n  - '.join(problems))


# ------------------------------------------------------------------ tokens
class TokenLayout(namedtuple('TokenLayout', ['cls_token', 'registers'])):
    """The extra tokens a ViT leads its sequence with: a class token or not, then
    ``registers`` register tokens."""

    @property
    def num_extra(self):
        return int(self.cls_token) + self.registers

    def __str__(self):
        parts = (['class token'] if self.cls_token else []) + (
            [f'{self.registers} register(s)'] if self.registers else [])
        return ' + '.join(parts) or 'none'


def token_layout(model):
    """The :class:`TokenLayout` of the first (outermost) module of ``model`` that declares
    ``with_cls_token``; None when none does."""
    for module in model.modules():
        with_cls_token = getattr(module, 'with_cls_token', None)
        if with_cls_token is not None:
            return TokenLayout(bool(with_cls_token),
                               int(getattr(module, 'num_register_tokens', 0) or 0))
    return None


def patch_tokens_only(student_layout, teacher_layout, requested=None):
    """Whether only the patch tokens are compared: asked for, or the two sequences lead with
    different extra tokens (or either layout is unknown)."""
    if requested not in (None, True, False):
        raise TypeError(f'patch_tokens_only must be None (automatic), True or False, got '
                        f'{requested!r}')
    return bool(requested) or None in (student_layout, teacher_layout) \
        or student_layout != teacher_layout


def input_token_problems(student_layout, teacher_layout):
    """For a student run on the teacher's own token sequence: it needs the teacher's extra
    tokens (it then sees the sequence) or none (it then sees the patch tokens)."""
    if student_layout.num_extra == 0 or student_layout == teacher_layout:
        return []
    return [f'the student leads its sequence with {student_layout.num_extra} extra tokens '
            f'({student_layout}), the teacher with {teacher_layout.num_extra} '
            f'({teacher_layout}): the student needs the same ones or none (patch tokens only)']


def align_tokens(student, teacher, num_patches, patch_only, is_map=False):
    """Student and teacher tokens restricted to those both compare.

    Both sequences end with the same ``num_patches`` patch tokens (same image, same grid);
    extra tokens, where present, lead. Everything is compared when the sequences have the
    same length and ``patch_only`` is False, the last ``num_patches`` tokens otherwise.
    ``is_map``: ``(..., N, N)`` maps, cut on both token axes; else ``(..., N, C)`` tokens.
    """
    if student.shape[-2] == teacher.shape[-2] and not patch_only:
        return student, teacher
    patches = slice(-num_patches, None)
    index = (..., patches, patches) if is_map else (..., patches, slice(None))
    return student[index], teacher[index]


# ------------------------------------------------------------------ loss weights
def check_loss_weight(value, name='loss_weight', positive=False, note=''):
    """``value`` as a float: a finite number, >= 0 (``positive``: > 0).

    Raises:
        TypeError: not a real number (a bool is refused too).
        ValueError: NaN, infinite, negative, or 0 when ``positive``.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f'{name} must be a number{note}, got {value!r} of type '
                        f'{type(value).__name__}')
    bound = '> 0' if positive else '>= 0'
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise ValueError(f'{name} must be a finite number {bound}{note}, got {value!r}')
    return float(value)
