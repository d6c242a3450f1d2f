"""The epilogue compiler: eta IR (traced in the guest by inferlet.eta) -> a program the engine
runs right after the model on the pass's logits.

    program = compile_program(ir, device=device, backend="auto")   # or ProgramCache().get(ir, device)
    outputs = program.run(env)                                     # list of tensors on the device

`ir` is the guest's ``{"ops": [[op, args], ...], "outputs": [ref, ...]}`` (a dict or its JSON
text). compile_program validates it statically (op names, arity, argument kinds, references
to earlier ops only, no use of `put` results, outputs in range, known model outputs) and raises
`EtaError` (a ValueError) naming the op index, the op and the problem; shape errors, a missing
lane or an empty channel raise EtaError from `run`. The op semantics are in `ops`.

Program: `hash` (blake2b of the canonical IR JSON), `backend` ("torch" or "triton"), `reads`
(the (lane, output name) pairs it reads), `run(env)`; and where `lanewise`, `run_lanes(env)`:
one run for the single read-out rows of many passes stacked, each with its own channels
(`LanesEnv`; programs that differ only in their channel ids share a `lane_key`). Backends: "torch" interprets the ops
with torch (CPU or CUDA); "triton" fuses the program into one kernel, one program instance per
read-out row (see triton_backend for what it covers; shapes it cannot fuse run the torch
interpreter, with the same results); "auto" is Triton on CUDA when triton imports and the
program's ops are covered, else torch. Triton is only imported by the Triton backend.

The Env of a pass (`Env` protocol; `TensorEnv` for plain tensors) gives model outputs by
(lane, name), channels (take/put) and the read-out row offsets (indptr); it raises
LookupError for a missing output or an empty channel, which `run` reports as EtaError.

Results: reduce_argmax, gumbel_max, nucleus_sample and masked_argmax return int64 indices; a
reduction of a [vocab] read gives a 0-d tensor, of a [rows, vocab] read a [rows] tensor.
"""
from .ops import DTYPES, MODEL_OUTPUTS, OPS, EtaError, argmax
from .program import Env, LanesEnv, Program, ProgramCache, TensorEnv, compile_program

__all__ = ["EtaError", "Env", "LanesEnv", "TensorEnv", "Program", "ProgramCache", "compile_program", "OPS",
           "DTYPES", "MODEL_OUTPUTS", "argmax"]
