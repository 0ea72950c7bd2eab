"""The constructor contract: ``options`` on each operator class names exactly the keyword
arguments its ``__init__`` takes besides ``embed_dims`` and ``num_heads``, so the backbone can
read what an operator accepts from its class."""
import inspect

import pytest

from linvit_mm.models.attention import BaseAttention, attention_class, attention_types


def constructor_options(cls):
    parameters = inspect.signature(cls.__init__).parameters
    return [name for name in parameters if name not in ('self', 'embed_dims', 'num_heads')]


@pytest.mark.parametrize('attn_type', attention_types())
def test_options_are_the_constructor_arguments(attn_type):
    cls = attention_class(attn_type)
    assert list(cls.options) == constructor_options(cls)


@pytest.mark.parametrize('attn_type', attention_types())
def test_every_operator_takes_the_common_arguments(attn_type):
    options = attention_class(attn_type).options
    assert options[:len(BaseAttention.options)] == BaseAttention.options
    assert {'rope', 'layer_scale_init_value'} <= set(options)
