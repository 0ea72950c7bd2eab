"""Refuse, before training, LoRA targets that adapt no layer; record what a merge needs."""
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.registry import HOOKS

from linvit_mm.staged import (RECORD_KEY, find_lora_models, linear_layer_names, lora_record,
                              unmatched_lora_targets)


@HOOKS.register_module()
class LoRATargetsHook(Hook):
    """Checks every ``LoRAModel`` of the model before the run: each of its ``targets`` must
    have adapted at least one linear layer. Records, in every checkpoint, what folding the
    factors into the weights needs.

    mmpretrain's ``LoRAModel`` refuses a set of targets of which none matched, but a target
    that matches nothing beside others that do (a typo, ``'ffn.fc1'`` for the MLP's
    ``'ffn.layers.0.0'``, a module that is not ``nn.Linear``) is dropped silently and the run
    trains less than asked. The error names such targets and lists the layers there are.
    A model without a LoRAModel is refused too (the hook was added by mistake).

    A checkpoint holds the factors, not ``alpha`` (which scales them) nor the frozen weights
    they were fitted to. The hook writes ``meta['linvit_mm']['lora']``: per LoRAModel its
    ``alpha``, ``rank``, ``targets`` and the SHA-256 of its frozen weights, hashed once when
    training starts (after the base checkpoint loaded). ``merge_lora.py`` refuses a config
    or base that differs. Its priority is ``LOW`` so that it adds to the record
    ``StagedRecordHook`` (``NORMAL``) writes rather than being overwritten by it.
    """

    priority = 'LOW'

    def __init__(self):
        self._base_digests = None

    @staticmethod
    def _model(runner):
        return runner.model.module if is_model_wrapper(runner.model) else runner.model

    def before_run(self, runner):
        model = self._model(runner)
        lora_models = find_lora_models(model)
        if not lora_models:
            raise ValueError(f'LoRATargetsHook: the model ({type(model).__name__}) holds no '
                             f'LoRAModel')
        problems = []
        for prefix, lora_model in lora_models.items():
            unmatched = unmatched_lora_targets(lora_model)
            if unmatched:
                problems.append(
                    f'LoRAModel {prefix.rstrip(".") or "(the model)"}: targets {unmatched} '
                    f'adapt no layer (a target is a full-match regular expression or a name '
                    f'suffix of an nn.Linear, and a layer goes to the first target that '
                    f'matches it); its linear layers are '
                    f'{", ".join(linear_layer_names(lora_model.module))}')
        if problems:
            raise ValueError('LoRATargetsHook:\n  - ' + '\n  - '.join(problems))

    def before_train(self, runner):
        # The frozen weights do not change during the run: hash them once, after
        # init_weights and any resume have loaded them.
        record = lora_record(self._model(runner))
        self._base_digests = {name: entry['base_sha256'] for name, entry in record.items()}

    def before_save_checkpoint(self, runner, checkpoint):
        record = checkpoint.setdefault('meta', {}).setdefault(RECORD_KEY, {})
        record['lora'] = lora_record(self._model(runner), self._base_digests)
