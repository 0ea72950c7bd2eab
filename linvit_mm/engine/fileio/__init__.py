from .atomic_local_backend import AtomicLocalBackend

__all__ = ['AtomicLocalBackend']
