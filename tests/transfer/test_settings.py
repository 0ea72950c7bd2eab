"""Initialisation settings (paper Table A): what each copies, Mimetic / Impulse, errors, report."""
import logging
import re
from collections import OrderedDict

import pytest
import timm
import torch
import torch.nn.functional as F
from mmengine.logging import MMLogger
from mmengine.registry import WEIGHT_INITIALIZERS

import linvit_mm.models  # noqa: F401  (registers LinearViT)
from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.testing import assert_rel_close
from linvit_mm.transfer import COMPONENTS, transfer_softmax_weights

OPERATORS = ('softmax', 'elu', 'relu', 'inline', 'mhla', 'ttt')
SETTINGS = ('random', 'mimetic', 'impulse', 'copy', 'mlpcopy', 'fullcopy')
SEED = 7
C, D, HEADS = 192, 64, 3  # DeiT-Tiny width, head dim, heads

# timm name -> LinearViT / VisionTransformerClsHead name, written out here independently of
# the code under test.
TIMM_BLOCK = {'norm1': 'ln1', 'attn.qkv': 'attn.qkv', 'attn.proj': 'attn.proj', 'norm2': 'ln2',
              'mlp.fc1': 'ffn.layers.0.0', 'mlp.fc2': 'ffn.layers.1'}
TIMM_TOP = {'cls_token': 'cls_token', 'pos_embed': 'pos_embed',
            'patch_embed.proj.weight': 'patch_embed.projection.weight',
            'patch_embed.proj.bias': 'patch_embed.projection.bias',
            'norm.weight': 'ln1.weight', 'norm.bias': 'ln1.bias'}

# Which backbone tensors each copying setting takes (TTT's wider qkv/proj handled below).
INTENDED = {
    'random': None,
    'mimetic': None,
    'impulse': None,
    'copy': re.compile(r'layers\.\d+\.attn\.(qkv|proj)\.(weight|bias)$'),
    'mlpcopy': re.compile(r'layers\.\d+\.(ffn\.layers\.(0\.0|1)|ln2)\.(weight|bias)$'),
    'fullcopy': re.compile(r'.*'),
}


def linvit_name(timm_name):
    if timm_name in TIMM_TOP:
        return TIMM_TOP[timm_name]
    _, idx, rest = timm_name.split('.', 2)
    module, param = rest.rsplit('.', 1)
    return f'layers.{idx}.{TIMM_BLOCK[module]}.{param}'


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    # Dozens of small SVDs and inits: two threads on a busy two-core machine run them
    # many times slower than one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope='module', autouse=True)
def quiet_logger():
    """A current MMLogger that drops mmengine's per-parameter init dump and the tables."""
    return MMLogger.get_instance('test_transfer_settings_quiet', log_level='WARNING')


@pytest.fixture(scope='module')
def sources(timm_sd):
    """Backbone tensors of the checkpoint under LinearViT names."""
    return {linvit_name(k): v for k, v in timm_sd.items() if not k.startswith('head.')}


@pytest.fixture(scope='module')
def ckpt_paths(tmp_path_factory, timm_sd, sources):
    root = tmp_path_factory.mktemp('softmax_ckpts')
    mmpretrain_sd = OrderedDict(('backbone.' + k, v) for k, v in sources.items())
    mmpretrain_sd['head.layers.head.weight'] = timm_sd['head.weight']
    mmpretrain_sd['head.layers.head.bias'] = timm_sd['head.bias']
    layouts = {'deit-official': {'model': timm_sd}, 'timm': timm_sd,
               'mmpretrain': {'state_dict': mmpretrain_sd, 'meta': {'epoch': 300}}}
    paths = {}
    for name, obj in layouts.items():
        paths[name] = root / f'{name}.pth'
        torch.save(obj, paths[name])
    return paths


def build(attn_type, **kwargs):
    torch.manual_seed(SEED)
    model = LinearViT(arch='tiny', attn_type=attn_type, **kwargs)
    model.init_weights()
    return model


def state(model):
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


@pytest.fixture(scope='module')
def random_state():
    cache = {}

    def get(attn_type):
        if attn_type not in cache:
            cache[attn_type] = state(build(attn_type))
        return cache[attn_type]

    return get


SOURCE_NAMES = {linvit_name(k) for k in
                [f'blocks.{i}.{m}.{p}' for i in range(12) for m in TIMM_BLOCK
                 for p in ('weight', 'bias')] + list(TIMM_TOP)}


def expected_copies(attn_type, setting, names):
    """{name: number of leading rows copied, or None for the whole tensor}."""
    pattern = INTENDED[setting]
    if pattern is None:
        return {}
    copies = {}
    for name in names:
        if not pattern.match(name) or name not in SOURCE_NAMES:
            continue
        if attn_type == 'ttt' and '.attn.proj.' in name:
            continue  # TTT's proj is (C, C + d): keeps its own init
        copies[name] = 3 * C if attn_type == 'ttt' and '.attn.qkv.' in name else None
    return copies


def assert_same_state(actual, expected):
    assert list(actual) == list(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


# --------------------------------------------------------------- every setting x operator


@pytest.mark.parametrize('setting', SETTINGS)
@pytest.mark.parametrize('attn_type', OPERATORS)
def test_setting_copies_exactly_the_intended_tensors(attn_type, setting, ckpt_paths, sources,
                                                     random_state):
    reference = random_state(attn_type)
    model = build(attn_type)
    if setting in ('mimetic', 'impulse') and attn_type == 'ttt':
        with pytest.raises(ValueError, match=r"not defined for the 'ttt'.*QK\^T"):
            transfer_softmax_weights(model, None, setting=setting)
        assert_same_state(state(model), reference)
        return

    checkpoint = None if setting in ('random', 'mimetic', 'impulse') else ckpt_paths['timm']
    report = transfer_softmax_weights(model, checkpoint, setting=setting)
    result = state(model)
    copies = expected_copies(attn_type, setting, result)
    analytic = set()
    if setting in ('mimetic', 'impulse'):
        analytic = {f'layers.{i}.attn.{layer}.weight' for i in range(12)
                    for layer in ('qkv', 'proj')}
        if setting == 'impulse' and model.pos_embed is not None:
            analytic.add('pos_embed')

    assert list(result) == list(reference)
    for name, value in result.items():
        if name in copies:
            rows = copies[name]
            if rows is None:
                assert torch.equal(value, sources[name]), name
            else:
                assert torch.equal(value[:rows], sources[name]), name
                assert torch.equal(value[rows:], reference[name][rows:]), name
        elif name == 'pos_embed' and setting == 'impulse':
            # the learned embedding is scaled so it dominates the patch embedding
            assert torch.equal(value, reference[name] * 18.), name
        elif name in analytic:
            assert not torch.equal(value, reference[name]), name
        else:
            assert torch.equal(value, reference[name]), name
    assert set(report['copied']) == set(copies)
    assert set(report['analytic']) == analytic
    if attn_type == 'ttt' and setting in ('copy', 'fullcopy'):
        assert set(report['partial']) == {n for n, rows in copies.items() if rows}
        assert 'operator-specific' in report['kept own init']['layers.0.attn.proj.weight']


@pytest.mark.parametrize('layout', ['deit-official', 'timm', 'mmpretrain'])
def test_fullcopy_reads_every_layout_alike(layout, ckpt_paths, sources):
    model = build('softmax')
    report = transfer_softmax_weights(model, ckpt_paths[layout], setting='fullcopy')
    assert report['source_format'] == layout
    assert_same_state(state(model), OrderedDict((k, sources[k]) for k in model.state_dict()))


def test_fullcopy_through_init_cfg_reproduces_timm_deit_logits(ckpt_paths, timm_deit):
    from mmpretrain.registry import MODELS
    path = str(ckpt_paths['deit-official'])
    classifier = MODELS.build(dict(
        type='ImageClassifier',
        backbone=dict(type='LinearViT', arch='tiny', attn_type='softmax',
                      init_cfg=dict(type='SoftmaxTransfer', checkpoint=path, setting='fullcopy')),
        head=dict(type='VisionTransformerClsHead', num_classes=1000, in_channels=C,
                  init_cfg=[dict(type='Constant', layer='Linear', val=0),
                            dict(type='SoftmaxTransfer', checkpoint=path, setting='fullcopy',
                                 prefix='head.')])))
    classifier.init_weights()
    classifier.eval()
    assert classifier.head.transfer_report['copied'] == ['layers.head.weight', 'layers.head.bias']
    assert len(classifier.backbone.transfer_report['copied']) == 150
    torch.manual_seed(3)
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        expected = timm_deit(images)
        logits = classifier(images, mode='tensor')
    assert_rel_close(logits, expected, 1e-5, 'logits')


def test_head_with_other_classes_keeps_its_init(ckpt_paths):
    from mmpretrain.models.heads import VisionTransformerClsHead
    head = VisionTransformerClsHead(num_classes=10, in_channels=C, init_cfg=[
        dict(type='Constant', layer='Linear', val=0),
        dict(type='SoftmaxTransfer', checkpoint=str(ckpt_paths['timm']), setting='fullcopy',
             prefix='head.')])
    head.init_weights()
    report = head.transfer_report
    assert report['copied'] == []
    assert report['kept own init'] == {
        name: 'shape differs: the checkpoint has 1000 classes, the model 10'
        for name in ('layers.head.weight', 'layers.head.bias')}
    assert report['counts']['head']['kept own init'] == 2
    assert not head.layers.head.weight.any() and not head.layers.head.bias.any()


def test_component_form_ablates_one_component(ckpt_paths, sources, random_state):
    without_cls = [name for name in COMPONENTS if name != 'cls_token']
    model = build('softmax')
    report = transfer_softmax_weights(model, ckpt_paths['timm'], components=without_cls)
    assert report['setting'] is None and report['components'] == without_cls
    assert report['kept own init'] == {'cls_token': 'not selected'}
    result = state(model)
    assert torch.equal(result['cls_token'], random_state('softmax')['cls_token'])
    for name, value in result.items():
        if name != 'cls_token':
            assert torch.equal(value, sources[name]), name

    every = build('softmax')
    transfer_softmax_weights(every, ckpt_paths['timm'], components=list(COMPONENTS))
    full = build('softmax')
    transfer_softmax_weights(full, ckpt_paths['timm'], setting='fullcopy')
    assert_same_state(state(every), state(full))


def test_pos_embed_is_resized_to_the_model_grid(ckpt_paths, timm_sd):
    from mmpretrain.models.utils import resize_pos_embed
    model = build('relu', img_size=112)
    report = transfer_softmax_weights(model, ckpt_paths['timm'], setting='fullcopy')
    expected = resize_pos_embed(timm_sd['pos_embed'], (14, 14), (7, 7), 'bicubic', 1)
    assert model.pos_embed.shape == (1, 50, C)
    assert torch.equal(model.pos_embed.detach(), expected)
    assert 'pos_embed' in report['copied']
    assert any('resized from 14x14 to 7x7' in note for note in report['notes'])


# --------------------------------------------------------------- Mimetic / Impulse


def test_mimetic_products_have_identity_plus_noise_structure():
    model = build('softmax')
    transfer_softmax_weights(model, setting='mimetic')
    # The formula's own expectation: mean diagonal / mean |off-diagonal| of the best rank-D
    # approximation of 0.7 Z + 0.7 I, Z ~ N(0, 1/C), estimated from independent draws.
    torch.manual_seed(11)
    ratios = []
    for _ in range(8):
        target = 0.7 * torch.randn(C, C, dtype=torch.float64) / C**0.5 + 0.7 * torch.eye(C)
        u, s, vh = torch.linalg.svd(target)
        ratios.append(diagonal_ratio((u[:, :D] * s[:D]) @ vh[:D]))
    expected_ratio = sum(ratios) / len(ratios)

    off = ~torch.eye(C, dtype=torch.bool)
    with torch.no_grad():
        for layer in model.layers:
            weight = layer.attn.qkv.weight.double()
            for head in range(HEADS):
                w_q = weight[head * D:(head + 1) * D]
                w_k = weight[C + head * D:C + (head + 1) * D]
                qk = w_q.T @ w_k
                assert torch.linalg.matrix_rank(qk) == D
                ratio = diagonal_ratio(qk)
                assert ratio > 5
                assert abs(ratio / expected_ratio - 1) < 0.1, (ratio, expected_ratio)
            # Tokens are rows: x -> x W_v^T W_proj^T should be 0.4 Z - 0.4 I at full rank.
            vo = weight[2 * C:].T @ layer.attn.proj.weight.double().T
            assert abs(vo.diagonal().mean().item() + 0.4) < 0.03
            assert abs(vo[off].std().item() / (0.4 / C**0.5) - 1) < 0.1


def diagonal_ratio(matrix):
    off = ~torch.eye(matrix.shape[0], dtype=torch.bool)
    return (matrix.diagonal().mean() / matrix[off].abs().mean()).item()


@pytest.mark.parametrize('attn_type', ['softmax', 'mhla'], ids=['learned-pos', 'sincos-pos'])
def test_impulse_heads_attend_to_their_offset_from_position_embeddings(attn_type):
    model = build(attn_type)
    transfer_softmax_weights(model, setting='impulse')
    H, W = model.patch_resolution
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    # centre first, then up and right (DeiT-Tiny has three heads)
    offsets = [(0, 0), (-1, 0), (0, 1)]
    with torch.no_grad():
        if model.pos_embed is not None:
            positions = model.pos_embed[0, model.num_extra_tokens:]
        else:
            positions = model.position_embedding((H, W), torch.empty(0))[0]
        hits, impulse_mass = [], []
        for layer in model.layers:
            # float64: the sin-cos scores are small enough for float32 rounding to tie them
            tokens = F.layer_norm(positions.double(), (C, ), layer.ln1.weight.double(),
                                  layer.ln1.bias.double(), layer.ln1.eps)
            qkv = F.linear(tokens, layer.attn.qkv.weight.double(), layer.attn.qkv.bias.double())
            maps = torch.stack([
                (qkv[:, h * D:(h + 1) * D] @ qkv[:, C + h * D:C + (h + 1) * D].T * D**-0.5)
                .softmax(-1) for h in range(HEADS)])
            for head, (dy, dx) in enumerate(offsets):
                inside = ((rows + dy >= 0) & (rows + dy < H) & (cols + dx >= 0)
                          & (cols + dx < W))
                target = ((rows + dy) * W + cols + dx)[inside]
                head_map = maps[head][inside]
                hits.append((head_map.argmax(-1) == target).double().mean().item())
                impulse_mass.append(head_map.gather(1, target[:, None]).mean().item())
    assert min(hits) > 0.9, hits
    assert sum(hits) / len(hits) > 0.97
    if attn_type == 'softmax':
        # the learned embedding, scaled by 18, gives sharp maps (measured ~0.86 here)
        assert sum(impulse_mass) / len(impulse_mass) > 0.7


# --------------------------------------------------------------- errors


def assert_nothing_copied(model, before):
    assert_same_state(state(model), before)


@pytest.mark.parametrize('setting,first', [
    ('fullcopy', 'backbone.cls_token: checkpoint (1, 1, 768) vs model (1, 1, 192)'),
    ('mlpcopy', 'backbone.layers.0.ln2.weight: checkpoint (768,) vs model (192,)'),
], ids=['fullcopy', 'mlpcopy'])
def test_deit_base_into_tiny_names_the_mismatch_and_copies_nothing(setting, first):
    torch.manual_seed(0)
    base_sd = timm.create_model('deit_base_patch16_224', pretrained=False).state_dict()
    model = build('relu')
    before = state(model)
    with pytest.raises(ValueError) as info:
        transfer_softmax_weights(model, {'model': base_sd}, setting=setting)
    message = str(info.value)
    assert first in message.splitlines()[2]
    assert 'embed_dims=768' in message and 'Nothing was copied' in message
    assert_nothing_copied(model, before)


def test_one_misfit_tensor_stops_every_copy(timm_sd):
    sd = OrderedDict(timm_sd)
    sd['blocks.11.mlp.fc1.weight'] = sd['blocks.11.mlp.fc1.weight'][:700]
    model = build('elu')
    before = state(model)
    with pytest.raises(ValueError, match=re.escape(
            'backbone.layers.11.ffn.layers.0.0.weight: checkpoint (700, 192) vs model '
            '(768, 192)')):
        transfer_softmax_weights(model, sd, setting='fullcopy')
    assert_nothing_copied(model, before)


def test_depth_mismatch_names_the_missing_blocks(timm_sd):
    shallow = OrderedDict((k, v) for k, v in timm_sd.items()
                          if not re.match(r'blocks\.([6-9]|1[01])\.', k))
    model = build('inline')
    before = state(model)
    with pytest.raises(ValueError, match=r'depth differs: the model has 12 blocks, the checkpoint '
                                         r'6; blocks 6-11 of the model are not in the checkpoint'):
        transfer_softmax_weights(model, shallow, setting='mlpcopy')
    assert_nothing_copied(model, before)


def test_unreadable_or_missing_checkpoints(tmp_path):
    model = build('softmax')
    wrong_layout = tmp_path / 'optimizer.pth'
    torch.save({'optimizer': {'lr': torch.tensor(0.1)}, 'epoch': 3}, wrong_layout)
    with pytest.raises(ValueError, match='unrecognised checkpoint layout.*Known formats'):
        transfer_softmax_weights(model, wrong_layout, setting='copy')
    truncated = tmp_path / 'interrupted_download.pth'
    torch.save({'model': {'pos_embed': torch.zeros(1, 197, C)}}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(ValueError, match='is not a PyTorch checkpoint'):
        transfer_softmax_weights(model, truncated, setting='copy')
    with pytest.raises(FileNotFoundError, match='missing.pth'):
        transfer_softmax_weights(model, tmp_path / 'missing.pth', setting='copy')
    with pytest.raises(ValueError, match='checkpoint is None'):
        transfer_softmax_weights(model, None, setting='fullcopy')


def test_bad_settings_list_the_valid_ones(ckpt_paths):
    model = build('softmax')
    with pytest.raises(ValueError, match='random, mimetic, impulse, copy, mlpcopy, fullcopy'):
        transfer_softmax_weights(model, ckpt_paths['timm'], setting='fullcpy')
    with pytest.raises(ValueError, match='attention, mlp, norms, patch_embed, pos_embed, '
                                         'cls_token, head'):
        transfer_softmax_weights(model, ckpt_paths['timm'], components=['mlp', 'ffn'])
    with pytest.raises(ValueError, match='not both'):
        transfer_softmax_weights(model, ckpt_paths['timm'], setting='copy', components=['mlp'])
    with pytest.raises(ValueError, match='valid options are'):
        transfer_softmax_weights(model, setting='mimetic', analytic_cfg=dict(alpha=1.))
    with pytest.raises(ValueError, match='checkpoint may be None only for random, mimetic'):
        WEIGHT_INITIALIZERS.build(dict(type='SoftmaxTransfer', setting='mlpcopy'))


# --------------------------------------------------------------- report and log


@pytest.mark.parametrize('attn_type,counts', [
    ('mhla', {'attention': (48, 36, 0), 'pos_embed': (0, 0, 1), 'cls_token': (0, 0, 1)}),
    ('ttt', {'attention': (24, 84, 0), 'pos_embed': (0, 0, 1), 'cls_token': (0, 0, 1)}),
    ('softmax', {'attention': (48, 0, 0), 'pos_embed': (1, 0, 0), 'cls_token': (1, 0, 0)}),
], ids=['mhla', 'ttt', 'softmax'])
def test_report_counts(attn_type, counts, ckpt_paths):
    model = build(attn_type)
    report = transfer_softmax_weights(model, ckpt_paths['timm'], setting='fullcopy')
    for component, (copied, kept, not_in_model) in counts.items():
        row = report['counts'][component]
        assert (row['copied'], row['kept own init'], row['not in model']) == (
            copied, kept, not_in_model), component
    assert report['counts']['mlp']['copied'] == 72  # fc1, fc2, ln2 of 12 blocks
    assert report['counts']['norms']['copied'] == 26  # ln1 of 12 blocks, final norm
    module_states = ('copied', 'analytic', 'kept own init', 'absent in checkpoint')
    assert sum(row[key] for row in report['counts'].values()
               for key in module_states) == len(model.state_dict())
    assert len(report['copied']) == sum(row['copied'] for row in report['counts'].values())
    if attn_type == 'mhla':
        assert report['not in model'] == ['cls_token', 'pos_embed']
        assert report['kept own init']['layers.3.attn.block_mixing'] == 'operator-specific'


def test_report_absent_tensors(timm_sd):
    backbone_only = OrderedDict((k, v) for k, v in timm_sd.items()
                                if not k.startswith('head.') and k != 'blocks.2.attn.qkv.bias')
    model = build('softmax')
    report = transfer_softmax_weights(model, backbone_only, setting='copy')
    assert report['absent in checkpoint'] == ['layers.2.attn.qkv.bias']
    assert report['counts']['attention']['absent in checkpoint'] == 1
    from mmpretrain.models.heads import VisionTransformerClsHead
    head = VisionTransformerClsHead(num_classes=1000, in_channels=C)
    head.init_weights()
    report = transfer_softmax_weights(head, backbone_only, setting='fullcopy', prefix='head.')
    assert report['absent in checkpoint'] == ['layers.head.weight', 'layers.head.bias']


def test_report_table_is_logged(ckpt_paths):
    logger = MMLogger.get_instance('test_transfer_settings_table', log_level='INFO')
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        transfer_softmax_weights(build('mhla'), ckpt_paths['deit-official'], setting='mlpcopy',
                                 logger='test_transfer_settings_table')
    finally:
        logger.removeHandler(handler)
    text = '\n'.join(record.getMessage() for record in records)
    assert "setting 'mlpcopy', checkpoint layout: deit-official" in text
    assert re.search(r'\| mlp +\| +72 \| +0 \| +0 \| +0 \| +0 \|', text)
    assert 'kept own init (not selected): ' in text


def test_analytic_settings_through_init_cfg_need_no_checkpoint():
    torch.manual_seed(SEED)
    via_cfg = LinearViT(arch='tiny', attn_type='relu',
                        init_cfg=dict(type='SoftmaxTransfer', setting='mimetic'))
    via_cfg.init_weights()
    assert len(via_cfg.transfer_report['analytic']) == 24
    direct = build('relu')
    transfer_softmax_weights(direct, setting='mimetic')
    assert_same_state(state(via_cfg), state(direct))


def test_impulse_offsets_cycle_when_heads_exceed_nine():
    # ViT-B widths (12 heads of 64) on a 7x7 grid: fewer tokens than a head has channels, so
    # the Gram's numerical rank (49) limits the pseudo-inverse.
    width, heads, d = 768, 12, 64
    torch.manual_seed(SEED)
    model = LinearViT(arch=dict(embed_dims=width, num_layers=1, num_heads=heads,
                                feedforward_channels=width), img_size=112, attn_type='softmax')
    model.init_weights()
    transfer_softmax_weights(model, setting='impulse')
    order = [(0, 0), (-1, 0), (0, 1), (0, -1), (1, 0), (-1, -1), (-1, 1), (1, -1), (1, 1)]
    H, W = model.patch_resolution
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    attn = model.layers[0].attn
    with torch.no_grad():
        tokens = model.layers[0].ln1(model.pos_embed[0, 1:]).double()
        qkv = F.linear(tokens, attn.qkv.weight.double(), attn.qkv.bias.double())
        for head in range(heads):
            dy, dx = order[head % 9]
            q = qkv[:, head * d:(head + 1) * d]
            k = qkv[:, width + head * d:width + (head + 1) * d]
            inside = (rows + dy >= 0) & (rows + dy < H) & (cols + dx >= 0) & (cols + dx < W)
            hits = ((q @ k.T).argmax(-1) == (rows + dy) * W + cols + dx)[inside].double().mean()
            assert hits > 0.9, (head, hits)
