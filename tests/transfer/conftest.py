"""The Softmax ViT every transfer test reads (timm's DeiT-Tiny with distinct tensors), its
names written out independently of the code under test, and the LinearViTs it goes into."""
import re
from collections import OrderedDict

import pytest
import timm
import torch
from mmengine.logging import MMLogger

import linvit_mm.models  # noqa: F401  (registers LinearViT)
import linvit_mm.transfer  # noqa: F401  (registers SoftmaxTransfer)
from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.transfer import transfer_softmax_weights

SEED = 7
# timm block suffix -> mmpretrain TransformerEncoderLayer suffix, written out here
# independently of the module under test.
TIMM_BLOCK = {'norm1': 'ln1', 'attn.qkv': 'attn.qkv', 'attn.proj': 'attn.proj', 'norm2': 'ln2',
              'mlp.fc1': 'ffn.layers.0.0', 'mlp.fc2': 'ffn.layers.1'}
TIMM_TOP = {'cls_token': 'backbone.cls_token', 'pos_embed': 'backbone.pos_embed',
            'patch_embed.proj.weight': 'backbone.patch_embed.projection.weight',
            'patch_embed.proj.bias': 'backbone.patch_embed.projection.bias',
            'norm.weight': 'backbone.ln1.weight', 'norm.bias': 'backbone.ln1.bias',
            'head.weight': 'head.layers.head.weight', 'head.bias': 'head.layers.head.bias'}


def mmpretrain_name(timm_name):
    if timm_name in TIMM_TOP:
        return TIMM_TOP[timm_name]
    _, idx, rest = timm_name.split('.', 2)
    module, param = rest.rsplit('.', 1)
    return f'backbone.layers.{idx}.{TIMM_BLOCK[module]}.{param}'


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    # Dozens of small SVDs, inits and copies: two threads on a busy two-core machine run them
    # many times slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module', autouse=True)
def quiet_logger(request):
    """A current MMLogger that drops mmengine's per-parameter init dump and the tables (one a
    module: the latest one created is mmengine's current logger)."""
    return MMLogger.get_instance(f'quiet_{request.module.__name__}', log_level='ERROR')


@pytest.fixture(scope='module')
def timm_deit():
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', pretrained=False).eval()
    # timm starts every norm at (1, 0) and every bias at 0, like our default init: identical
    # tensors would hide a swapped mapping or a copy that did not happen, so give every
    # tensor its own values.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


@pytest.fixture(scope='module')
def timm_sd(timm_deit):
    """Its state dict in timm's layout (detached copies)."""
    return OrderedDict((k, v.detach().clone()) for k, v in timm_deit.state_dict().items())


@pytest.fixture(scope='module')
def timm_sd_fc_norm(timm_sd):
    """``timm_sd`` with its final norm named as timm's / MAE's pooled-token norm, ``fc_norm``."""
    return OrderedDict((k.replace('norm.', 'fc_norm.', 1) if k.startswith('norm.') else k, v)
                       for k, v in timm_sd.items())


@pytest.fixture(scope='module')
def expected(timm_sd):
    """The same tensors under mmpretrain names, in timm's order."""
    return OrderedDict((mmpretrain_name(k), v) for k, v in timm_sd.items())


@pytest.fixture(scope='module')
def sources(expected):
    """Backbone tensors of the checkpoint under LinearViT names."""
    return OrderedDict((k[len('backbone.'):], v) for k, v in expected.items()
                       if k.startswith('backbone.'))


@pytest.fixture(scope='module')
def ckpt_paths(tmp_path_factory, timm_sd, expected):
    root = tmp_path_factory.mktemp('softmax_ckpts')
    layouts = {'deit-official': {'model': timm_sd}, 'timm': timm_sd,
               'mmpretrain': {'state_dict': expected, 'meta': {'epoch': 300}}}
    paths = {}
    for name, obj in layouts.items():
        paths[name] = root / f'{name}.pth'
        torch.save(obj, paths[name])
    return paths


def build_vit(attn_type, **kwargs):
    torch.manual_seed(SEED)
    model = LinearViT(**dict(dict(arch='tiny', attn_type=attn_type), **kwargs))
    model.init_weights()
    return model


def state_of(model):
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


@pytest.fixture(scope='session')
def build():
    """``build(attn_type, **LinearViT kwargs)``: a DeiT-Tiny-shaped LinearViT, fixed seed."""
    return build_vit


@pytest.fixture(scope='session')
def state():
    """``state(model)``: detached copies of its state dict."""
    return state_of


@pytest.fixture(scope='module')
def random_state():
    """``random_state(attn_type)``: the state :func:`build` gives, built once per operator."""
    cache = {}

    def get(attn_type):
        if attn_type not in cache:
            cache[attn_type] = state_of(build_vit(attn_type))
        return cache[attn_type]

    return get


@pytest.fixture(scope='session')
def assert_same_state():

    def check(actual, expected):
        assert list(actual) == list(expected)
        for name in expected:
            assert torch.equal(actual[name], expected[name]), name

    return check


@pytest.fixture(scope='session')
def refuses(state, assert_same_state):
    """``refuses(model, checkpoint, match=None, **options)``: the transfer raises a ValueError
    (matching ``match``) and leaves every tensor of ``model`` as it was; returns the message."""

    def check(model, checkpoint, match=None, **options):
        before = state(model)
        with pytest.raises(ValueError, match=match) as info:
            transfer_softmax_weights(model, checkpoint, **options)
        assert_same_state(state(model), before)
        return str(info.value)

    return check


# --------------------------------------------------------------- foundation-model sources

# arch word -> timm model of that family. At test size (below) every switch of the family is
# kept; only the sizes shrink.
SOURCE_MODELS = {
    'dinov2-small': 'vit_small_patch14_dinov2',
    'dinov2-reg-small': 'vit_small_patch14_reg4_dinov2',
    'dinov3-small': 'vit_small_patch16_dinov3',
    'deit3-small': 'deit3_small_patch16_224',
    'clip-base': 'vit_base_patch16_clip_quickgelu_224',
    'eva02-tiny': 'eva02_tiny_patch14_224',
    'eva02-base': 'eva02_base_patch14_224',
}
SOURCE_TEST_SIZE = dict(depth=2, embed_dim=64, num_heads=4)


def make_timm_source(word, img_size, **kwargs):
    """The timm model of ``word``'s family at test size (or ``kwargs``' sizes), num_classes=0,
    in float64, every tensor moved off its init: timm starts norms at (1, 0), biases and
    EVA's q/v biases at 0 and LayerScale at 1e-5, which would hide a swapped or lost tensor."""
    torch.manual_seed(SEED)
    model = timm.create_model(SOURCE_MODELS[word], pretrained=False, img_size=img_size,
                              num_classes=0, **dict(SOURCE_TEST_SIZE, **kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(('gamma', 'gamma_1', 'gamma_2')):
                param.uniform_(.5, 1.)
            else:
                param.add_(0.1 * torch.randn_like(param))
    return model.double().eval()


def source_arch(word, model):
    """``word``'s arch at the sizes of the timm ``model``."""
    blocks = model.blocks
    mlp = blocks[0].mlp
    hidden = (mlp.fc2.in_features if hasattr(mlp, 'fc2') else None)
    return dict(LinearViT.arch_zoo[word], embed_dims=model.embed_dim, num_layers=len(blocks),
                num_heads=blocks[0].attn.num_heads, feedforward_channels=hidden)


def _rename(key, rules):
    for pattern, replacement in rules:
        key = re.sub(pattern, replacement, key)
    return key


def _renamed(state, rules):
    return OrderedDict((_rename(key, rules), value) for key, value in state.items())


_EVA02_RELEASE = [
    (r'\.mlp\.fc1_g\.', '.mlp.w1.'), (r'\.mlp\.fc1_x\.', '.mlp.w2.'), (r'\.mlp\.fc2\.', '.mlp.w3.'),
    (r'\.mlp\.norm\.', '.mlp.ffn_ln.'), (r'\.attn\.q_proj\.bias$', '.attn.q_bias'),
    (r'\.attn\.v_proj\.bias$', '.attn.v_bias'), (r'^fc_norm\.', 'norm.')]
_CLIP_RELEASE = [
    (r'^patch_embed\.proj\.', 'conv1.'), (r'^norm_pre\.', 'ln_pre.'), (r'^norm\.', 'ln_post.'),
    (r'^blocks\.', 'transformer.resblocks.'), (r'\.norm(\d)\.', r'.ln_\1.'),
    (r'\.attn\.qkv\.weight$', '.attn.in_proj_weight'),
    (r'\.attn\.qkv\.bias$', '.attn.in_proj_bias'), (r'\.attn\.proj\.', '.attn.out_proj.'),
    (r'\.mlp\.fc1\.', '.mlp.c_fc.'), (r'\.mlp\.fc2\.', '.mlp.c_proj.')]


def release_of(word, timm_state):
    """The original release layout of the family of ``word`` holding the same weights: the
    inverse of what timm's checkpoint_filter_fn does to read that release (written here
    from timm's filters, independently of linvit_mm.transfer.releases)."""
    generator = torch.Generator().manual_seed(11)
    state = OrderedDict((k, v.clone()) for k, v in timm_state.items())
    C = state['patch_embed.proj.weight'].shape[0]
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa
    if word.startswith('dinov2'):
        state['mask_token'] = rand(1, C)
        if 'reg_token' in state:
            # timm: cls_token = cls + pos[:, 0]; pos_embed = pos[:, 1:]
            slot = rand(1, 1, C)
            state['register_tokens'] = state.pop('reg_token')
            state['cls_token'] = state['cls_token'] - slot
            state['pos_embed'] = torch.cat([slot, state['pos_embed']], dim=1)
        return state
    if word.startswith('dinov3'):
        state = _renamed(state, [(r'^reg_token$', 'storage_tokens'),
                                 (r'\.gamma_1$', '.ls1.gamma'), (r'\.gamma_2$', '.ls2.gamma')])
        for key in [k for k in state if k.endswith('.attn.qkv.weight')]:
            block = key[:-len('weight')]
            state[block + 'bias'] = torch.zeros(3 * C, dtype=torch.float64)
            state[block + 'bias_mask'] = torch.cat([torch.ones(C), torch.zeros(C),
                                                    torch.ones(C)]).double()
        head_dims = C // 4
        state['rope_embed.periods'] = rand(head_dims // 4).abs()
        state['mask_token'] = rand(1, C)
        return state
    if word.startswith('eva02'):
        out = OrderedDict()
        for key, value in state.items():
            if key.endswith('.mlp.fc1.weight') or key.endswith('.mlp.fc1.bias'):
                gate, value_rows = value.chunk(2)  # GluMlp: gate rows first
                out[key.replace('fc1', 'w1')], out[key.replace('fc1', 'w2')] = gate, value_rows
                continue
            out[_rename(key, _EVA02_RELEASE)] = value
        out['mask_token'] = rand(1, 1, C)
        out['lm_head.weight'] = rand(8, C)
        out['rope.freqs_cos'] = rand(16, 16)
        out['rope.freqs_sin'] = rand(16, 16)
        return out
    if word.startswith('deit3'):
        # the DeiT repository's {'model': ...} with gamma_1 / gamma_2 (timm: ls1 / ls2.gamma)
        return {'model': _renamed(state, [(r'\.ls(\d)\.gamma$', r'.gamma_\1')]),
                'epoch': 799}
    if word.startswith('clip'):
        visual = _renamed(state, _CLIP_RELEASE)
        visual['class_embedding'] = visual.pop('cls_token').reshape(C)
        visual['positional_embedding'] = visual.pop('pos_embed')[0]
        visual['proj'] = rand(C, 32)
        out = OrderedDict(('visual.' + k, v) for k, v in visual.items())
        # the text tower, with block names like the image tower's
        out.update({'positional_embedding': rand(77, C), 'token_embedding.weight': rand(100, C),
                    'transformer.resblocks.0.attn.in_proj_weight': rand(3 * C, C),
                    'ln_final.weight': rand(C), 'text_projection': rand(C, 32),
                    'logit_scale': rand(())})
        return out
    raise KeyError(f'no release layout for {word}')


@pytest.fixture(scope='session')
def timm_source():
    """``timm_source(word, img_size=56, **timm kwargs)``: :func:`make_timm_source`."""
    return lambda word, img_size=56, **kwargs: make_timm_source(word, img_size, **kwargs)


@pytest.fixture(scope='session')
def release():
    """``release(word, timm_state)``: :func:`release_of`."""
    return release_of


@pytest.fixture(scope='session')
def arch_of():
    """``arch_of(word, timm_model)``: :func:`source_arch`."""
    return source_arch
