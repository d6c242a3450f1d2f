"""wasmtime's pooling instance allocator, set on an engine's Config through wasmtime's C API
(wasmtime-py does not expose it).

Why: by default wasmtime maps each new instance's linear memory afresh, copy-on-write from the
component's memory image (the runner's snapshot of CPython, ~16 MiB), and unmaps it when the run
ends. The guest reads a page before it writes it (a reference count is a load, then a store), so
each of the ~600 image pages a run writes costs a read fault and then a copy whose TLB flush
interrupts every other core of the process, the engine's threads included (~15 µs a page on the
hosts here, against ~2 µs for a plain copy), and finding and mapping a new instance's memory takes
the process's memory-map lock, which every fault of every thread waits on. The pool keeps a slot
per concurrent instance, reused by the same component: its memory stays mapped, and the first
`KEEP_RESIDENT` bytes of it stay resident, reset in place when a run ends, so the next run finds
its pages private and writable already. A run's host CPU: bench/RESULTS.md, "Sandbox memory:
pooled instance slots".

What it costs: `SLOTS` instances may be alive at once in a process (each engine: the process has
one, `build.shared_engine`); one more fails to instantiate, with an error that says so, and
leaves the others running. The slots reserve address space (4 GiB each, wasmtime's default for a
32-bit memory, whose bounds checks it then leaves out), and a slot that has served a run keeps its
memory image resident, copied whole (~16 MiB for the runner) the first time it is reset: that
first run costs a slot ~4,400 page faults, every later one ~15 instead of ~700. So resident memory
grows with the most runs a process has held at once, and at most `WARM_SLOTS` idle slots keep it.
"""
from __future__ import annotations

import ctypes

SLOTS = 1000                  # instances alive at once in a process: wasmtime's default pool size
KEEP_RESIDENT = 32 << 20      # bytes of a slot's memory kept resident and reset in place
CORE_INSTANCES = 32           # core instances a component may hold (the runner has 14)
WARM_SLOTS = 64               # idle slots that keep their memory for the next run (then it is let go)
TABLES = 8                    # tables a component may hold (the runner has 2)
TABLE_ELEMENTS = 65536        # elements a pooled table may grow to (RunLimits.table_elements' default)
MAX_MEMORY = 4 << 30          # a pooled memory may grow to the wasm32 limit; RunLimits bound a run

EXHAUSTED = "concurrent"      # in wasmtime's error when every slot is taken ("maximum concurrent ... limit")


def _c(name: str, *argtypes) -> ctypes._CFuncPtr:
    from wasmtime import _ffi

    fn = getattr(_ffi.dll, name)
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, *argtypes]
    return fn


def use_pool(config, slots: int = SLOTS) -> None:
    """Give a `wasmtime.Config` (before its Engine is made) the pooling allocator, with room for
    `slots` instances at once."""
    from wasmtime import _ffi

    new = _ffi.dll.wasmtime_pooling_allocation_config_new
    new.restype, new.argtypes = ctypes.c_void_p, []
    pool = new()
    u32, size = ctypes.c_uint32, ctypes.c_size_t
    try:
        for setting, ctype, value in [
                ("total_component_instances", u32, slots), ("total_memories", u32, slots),
                ("total_core_instances", u32, slots * CORE_INSTANCES), ("total_tables", u32, slots * TABLES),
                ("max_core_instances_per_component", u32, CORE_INSTANCES),
                ("max_tables_per_component", u32, TABLES), ("table_elements", size, TABLE_ELEMENTS),
                ("max_memory_size", size, MAX_MEMORY), ("linear_memory_keep_resident", size, KEEP_RESIDENT),
                ("max_unused_warm_slots", u32, WARM_SLOTS)]:
            _c(f"wasmtime_pooling_allocation_config_{setting}_set", ctype)(pool, value)
        strategy = _c("wasmtime_pooling_allocation_strategy_set", ctypes.c_void_p)
        strategy(ctypes.cast(config.ptr(), ctypes.c_void_p), pool)
    finally:
        _c("wasmtime_pooling_allocation_config_delete")(pool)
