# Demo step 2, setting "random" (configs/demo/_base_/linvit-relu-mini_mini-groups.py): nothing
# is copied from the teacher.
_base_ = ['./_base_/linvit-relu-mini_mini-groups.py']
