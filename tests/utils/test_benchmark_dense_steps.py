"""linvit_mm.utils.benchmark.dense: the windowed variant and the activations a step saves."""
import torch

from linvit_mm.utils.benchmark import dense, parse_arch

ARCH = '{"embed_dims": 32, "num_layers": 8, "num_heads": 2, "feedforward_channels": 64}'


def test_the_windowed_variant_windows_the_protocol_blocks():
    model = dense.build('plain', 'softmax-win', parse_arch(ARCH), 'cpu')
    assert [layer.window_size for layer in model.vit.layers] == \
        [(14, 14), None, (14, 14), None, (14, 14), None, (14, 14), None]
    assert dense.windowed_blocks(12) == [0, 1, 3, 4, 6, 7, 9, 10]
    glob = dense.build('adapter', 'softmax', parse_arch(ARCH), 'cpu')
    assert all(layer.window_size is None for layer in glob.vit.layers)


def test_saved_bytes_grow_with_the_tokens():
    """The activation count follows the input: a linear operator's grows about linearly."""
    arch = parse_arch(ARCH)
    model = dense.build('plain', 'relu', arch, 'cpu')
    small = dense.time_train_step(model, torch.randn(1, 3, 64, 64), 'cpu')[1]
    large = dense.time_train_step(model, torch.randn(1, 3, 128, 128), 'cpu')[1]
    assert 3.5 < large / small < 4.5
