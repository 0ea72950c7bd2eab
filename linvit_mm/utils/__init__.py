from .checkpoint import (UnsafeCheckpointError, install_checkpoint_policy, load_checkpoint_file,
                         load_weights_only)
from .compat import register_config_scope

__all__ = ['UnsafeCheckpointError', 'install_checkpoint_policy', 'load_checkpoint_file',
           'load_weights_only', 'register_config_scope']
