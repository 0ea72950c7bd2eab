from .checkpoint import load_weights_only, trust_checkpoint, trust_run_dir
from .compat import register_config_scope

__all__ = ['load_weights_only', 'register_config_scope', 'trust_checkpoint', 'trust_run_dir']
