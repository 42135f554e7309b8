import os

# The CPU attention kernels reuse per-thread scratch across calls; poisoned with NaN on every call
# here, a kernel that reads scratch it did not write in the same call fails the tests instead of
# silently using a stale value.
os.environ.setdefault("KVKERNELS_CPU_POISON_SCRATCH", "1")
