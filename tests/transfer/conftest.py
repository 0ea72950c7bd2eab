"""The Softmax ViT every transfer test reads (timm's DeiT-Tiny with distinct tensors), its
names written out independently of the code under test, and the LinearViTs it goes into."""
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
