"""The ``moshi`` backend: Kyutai's full-duplex models (Moshi, Hibiki, Hibiki-Zero) served through
the ``moshi`` package, one fixed batch of slots for the life of the process.

Importing this package does not import torch's model code or ``moshi``; ``MoshiBackend.load``
does, on the scheduler thread.
"""

from duplexrt.backends.moshi.backend import DEFAULTS, STAGES, MoshiBackend, MoshiSettings

__all__ = ["DEFAULTS", "STAGES", "MoshiBackend", "MoshiSettings"]
