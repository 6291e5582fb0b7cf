"""The scheduler service: batching, the KV cache and the forward loop.

Importing the package asks torch for transparent huge pages on its CPU allocations of 2 MiB and more
(the KV pool, the decode cache, a prefill's activations), unless THP_MEM_ALLOC_ENABLE is already set.
A decode step streams every running request's K/V, and with 4 KiB pages each fresh page of a big
temporary is a fault of its own (~3 us in this VM). Measured served, three runs each: decode steps
4-6 % shorter, 2-4x fewer page faults in the scheduler (docs/benchmarks.md). torch reads the variable
once, at its first allocation, so it is set here, before `python -m services.scheduler` (or the
bench's in-process engine) imports torch.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
