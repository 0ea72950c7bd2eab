from .attention_distill_hook import AttentionDistillHook
from .cpu_thread_hook import CPUThreadHook
from .finite_loss_hook import FiniteLossHook
from .lora_targets_hook import LoRATargetsHook
from .resume_lr_hook import ResumeLRScaleHook
from .staged_record_hook import StagedRecordHook

__all__ = ['AttentionDistillHook', 'CPUThreadHook', 'FiniteLossHook', 'LoRATargetsHook',
           'ResumeLRScaleHook', 'StagedRecordHook']
