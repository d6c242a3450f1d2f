"""The sandbox's host imports, registered with wasmtime's component C API directly.

wasmtime-py's `LinkerInstance.add_func` serves every call of a host function through one generic
callback that asks the C API for the function's type and rebuilds its parameter and result types
as Python objects, then converts each value through them (a `result<string, string>` asks for its
case types several times over): most of a host call's cost. The host interface (wit/inferlet.wit)
has fixed types, strings, a u32 and `result<string, string>`, so `add_func` here registers a
callback that converts exactly those, with the same C calls the generic path ends up making.

`PIE_WASM_IMPORTS=generic` registers them through wasmtime-py's `add_func` instead (the switch, for
the comparison in bench/RESULTS.md and for a wasmtime-py whose internals this module no longer fits).
"""
from __future__ import annotations

import ctypes
import itertools
import os
from ctypes import byref
from typing import Any, Callable

from wasmtime import WasmtimeError, _ffi as ffi
from wasmtime.component import LinkerInstance, Variant

__all__ = ["add_func", "STRING", "U32", "RESULT", "DIRECT"]

DIRECT = os.environ.get("PIE_WASM_IMPORTS", "direct") != "generic"

STRING, U32, RESULT = "string", "u32", "result<string, string>"

_funcs: dict[int, tuple[Callable[..., Any], tuple[str, ...], str | None]] = {}
_next_id = itertools.count(1)


def _gil_held(name: str, restype: Any, *argtypes: Any) -> Any:
    """wasmtime's C function `name`, called without releasing the interpreter lock. wasmtime-py's
    bindings (and `ctypes.memmove`) release it around every call, and a callback's small
    allocations take well under a microsecond: releasing the lock there lets another thread (the
    engine's, busy with Python) take it, and this one then waits for it, up to the interpreter's
    switch interval, several times a host call."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ffi.dll))


_byte_vec_new = _gil_held("wasm_byte_vec_new", None, ctypes.POINTER(ffi.wasm_byte_vec_t), ctypes.c_size_t,
                          ctypes.c_char_p)
_byte_vec_delete = _gil_held("wasm_byte_vec_delete", None, ctypes.POINTER(ffi.wasm_byte_vec_t))
_val_new = _gil_held("wasmtime_component_val_new", ctypes.POINTER(ffi.wasmtime_component_val_t),
                     ctypes.POINTER(ffi.wasmtime_component_val_t))


def _read(kind: str, value: Any) -> Any:
    if kind == U32:
        return value.of.u32
    vec = value.of.string
    text = ctypes.string_at(vec.data, vec.size).decode("utf-8")
    _byte_vec_delete(byref(vec))
    return text


def _string(slot: Any, text: str) -> None:
    data = text.encode("utf-8")
    vec = ffi.wasm_byte_vec_t()
    _byte_vec_new(byref(vec), len(data), data)
    slot.kind = ffi.WASMTIME_COMPONENT_STRING
    slot.of.string = vec


def _write(kind: str, value: Any, slot: Any) -> None:
    if kind == STRING:
        _string(slot, value)
        return
    if not isinstance(value, Variant) or value.tag not in ("ok", "err"):
        raise TypeError(f"a {RESULT} import returns Variant('ok' | 'err', str), not {value!r}")
    payload = ffi.wasmtime_component_val_t()
    _string(payload, value.payload)
    slot.kind = ffi.WASMTIME_COMPONENT_RESULT
    slot.of.result.is_ok = value.tag == "ok"
    slot.of.result.val = _val_new(byref(payload))


@ffi.wasmtime_component_func_callback_t
def _callback(env, context, func_type, args, nargs, results, nresults):
    func, params, result = _funcs[env or 0]
    try:
        value = func(None, *[_read(kind, args[i]) for i, kind in enumerate(params)])
        if result is not None:
            _write(result, value, results[0])
    except WasmtimeError as e:
        return ctypes.cast(e._consume(), ctypes.c_void_p).value
    except Exception as e:       # a bug here: a trap, never a Python exception across the C frames
        return ctypes.cast(WasmtimeError(f"host import failed: {type(e).__name__}: {e}")._consume(),
                           ctypes.c_void_p).value
    return 0


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _finalize(env):
    funcs = _funcs           # None once the interpreter, shutting down, has cleared this module
    if funcs is not None:
        funcs.pop(env or 0, None)


# wasmtime holds only the callbacks' C addresses, and may drop a linker (calling `_finalize`) during
# interpreter shutdown, after this module's objects are gone: keep both for good
for _thunk in (_callback, _finalize):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_thunk))


def add_func(instance: LinkerInstance, name: str, func: Callable[..., Any], params: tuple[str, ...],
             result: str | None) -> None:
    """Register host import `name`, whose WIT parameters are `params` (STRING / U32) and result
    `result` (STRING, RESULT or None); `func(store, *args)` is called as `LinkerInstance.add_func`
    calls it (the store is None here: the imports do not use it)."""
    if not DIRECT:
        instance.add_func(name, func)
        return
    key = next(_next_id)
    _funcs[key] = (func, params, result)
    raw = name.encode("utf-8")
    error = ffi.wasmtime_component_linker_instance_add_func(
        instance.ptr(), ctypes.create_string_buffer(raw), len(raw), _callback, key, _finalize)
    if error:
        _funcs.pop(key, None)
        raise WasmtimeError._from_ptr(error)
