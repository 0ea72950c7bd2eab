"""The arch table: plain data, the one place for each family's heads, RoPE, registers and MLP,
read by LinearViT's arch words and by the transfer's source families alike."""
import pytest

from linvit_mm.models.backbones import arch_zoo
from linvit_mm.models.backbones.arch_settings import family_switches, word_settings
from linvit_mm.models.backbones.linear_vit import LinearViT
from linvit_mm.transfer import load_softmax_checkpoint
from linvit_mm.transfer.families import FAMILIES, _family

SOURCE_WORDS = [word for word, entry in arch_zoo.ARCH_WORDS.items()
                if entry.get('family') in arch_zoo.FAMILIES]
SMALL = dict(embed_dims=64, num_layers=1, num_heads=4, feedforward_channels=96)


def plain_data(value):
    if isinstance(value, dict):
        return all(isinstance(key, (str, int)) and plain_data(item) for key, item in value.items())
    if isinstance(value, (tuple, list)):
        return all(plain_data(item) for item in value)
    return value is None or isinstance(value, (bool, int, float, str))


def test_the_table_is_plain_data():
    tables = {name: value for name, value in vars(arch_zoo).items() if name.isupper()}
    assert set(tables) == {'ARCH_ESSENTIALS', 'ARCH_SWITCH_DEFAULTS', 'OVERRIDABLE_SWITCHES',
                           'FFN_TYPES', 'FAMILIES', 'LINEAR_FAMILIES', 'ARCH_WORDS',
                           'ARCH_ALIASES'}
    assert all(plain_data(value) for value in tables.values())


def test_the_transfer_families_are_the_tables():
    assert list(FAMILIES) == list(arch_zoo.FAMILIES)  # the order families are inferred in
    for name, entry in arch_zoo.FAMILIES.items():
        rope = entry['switches'].get('rope')
        assert FAMILIES[name].heads == entry['heads']
        assert FAMILIES[name].rope == (rope['type'] if rope else None)
        assert FAMILIES[name].description == entry['description']


@pytest.mark.parametrize('word', SOURCE_WORDS)
def test_a_source_word_has_its_familys_settings(word):
    family = arch_zoo.ARCH_WORDS[word]['family']
    settings = LinearViT.arch_zoo[word]
    assert settings['num_heads'] == FAMILIES[family].heads[settings['embed_dims']]
    rope = settings.get('rope')
    assert (rope['type'] if rope else None) == FAMILIES[family].rope
    switches = family_switches(family, arch_zoo.ARCH_WORDS[word].get('variant'))
    assert {key: settings[key] for key in switches} == switches


@pytest.mark.parametrize('word', SOURCE_WORDS)
def test_a_source_words_checkpoint_is_recognised_as_its_family(word):
    """A model of the word (softmax, small sizes, every switch kept) saved as a checkpoint:
    its tensors alone name the word's family and its RoPE and registers."""
    arch = dict(LinearViT.arch_zoo[word], **SMALL)
    model = LinearViT(arch=arch, img_size=4 * arch['patch_size'])
    state = {f'backbone.{key}': value for key, value in model.state_dict().items()}
    ckpt = load_softmax_checkpoint({'state_dict': state})
    family = arch_zoo.ARCH_WORDS[word]['family']
    assert (ckpt.family, ckpt.family_from) == (family, 'its tensors')
    assert ckpt.rope == FAMILIES[family].rope
    assert ckpt.num_register_tokens == arch.get('num_register_tokens', 0)
    assert ckpt.ffn_type == arch.get('ffn_type', 'mlp')


def test_a_family_follows_its_table_entry():
    entry = arch_zoo.FAMILIES['dinov3']
    moved = _family('dinov3', dict(entry, heads={64: 4},
                                   switches=dict(entry['switches'], num_register_tokens=0,
                                                 rope=dict(type='eva'))))
    assert (moved.heads, moved.rope) == ({64: 4}, 'eva')
    assert FAMILIES['dinov3'].contradictions(_arch(num_register_tokens=0)) == [
        'num_register_tokens=0']
    assert moved.contradictions(_arch(num_register_tokens=0)) == []


def _arch(**changes):
    from linvit_mm.transfer.families import Architecture
    fields = dict(num_register_tokens=4, layer_scale=True, ffn_type='mlp', ffn_norm=False,
                  pre_norm=False, qkv_bias=False, pos_embed=False, pos_embed_extra_tokens=None)
    return Architecture(**dict(fields, **changes))


def test_words_and_aliases():
    assert set(LinearViT.arch_zoo) == set(arch_zoo.ARCH_WORDS) | set(arch_zoo.ARCH_ALIASES)
    for alias, word in arch_zoo.ARCH_ALIASES.items():
        assert LinearViT.arch_zoo[alias] == word_settings(word)


def test_an_unknown_variant_is_refused_by_name():
    with pytest.raises(KeyError, match="the 'clip' family has no variant 'reg'; it has "
                                       r"\['gelu'\]"):
        family_switches('clip', 'reg')
