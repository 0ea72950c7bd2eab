"""Softmax-to-linear weight transfer: checkpoint readers and initialisation settings."""
from .analytic import IMPULSE_DEFAULTS, MIMETIC_DEFAULTS
from .checkpoint import KNOWN_FORMATS, SoftmaxCheckpoint, load_softmax_checkpoint
from .initializer import SoftmaxTransferInit
from .settings import COMPONENTS, SETTINGS
from .transfer import transfer_softmax_weights

__all__ = ['KNOWN_FORMATS', 'SoftmaxCheckpoint', 'load_softmax_checkpoint']
__all__ += ['COMPONENTS', 'IMPULSE_DEFAULTS', 'MIMETIC_DEFAULTS', 'SETTINGS', 'SoftmaxTransferInit',
            'transfer_softmax_weights']
