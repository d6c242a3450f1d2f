"""Reference systems for the engine benchmark: transformers `generate`, a plain eager torch decode loop,
and llama.cpp. Each is a `Run` (prefill and decode timed apart); `measure` times several systems
round by round, so that the machine's drift hits them alike: a warm-up run each, then `repeats`
rounds of one timed run per system, and the median of each.

Every timed call gets fresh random prompts, so no system (the engine's prefix cache, llama.cpp's
prefix reuse) can answer a prefill from a cache filled by an earlier call.
"""
from __future__ import annotations

import copy
import functools
import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# transformers' per-tensor GGUF progress bars would bury the output; tqdm reads this once, at its import
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np
import torch
import torch.nn.functional as F

FIRST_PLAIN_TOKEN = 17  # SmolLM2 ids 0..16 are special tokens (<|im_start|>, <|endoftext|>, ...)
# ChatML "What is the capital of France?" with SmolLM2's default system prompt: a real prompt for the
# correctness checks (random ids make the model repeat itself, which agrees too easily)
CHECK_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
THREADS = os.cpu_count() or 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Speed:
    decode: float   # generated tokens/s summed over the batch, the first (prefill) token excluded
    prefill: float  # prompt tokens/s summed over the batch


# (batch, prompt_len, new_tokens) -> (prefill seconds, decode seconds)
Run = Callable[[int, int, int], tuple[float, float]]
# (prompts, max_new_tokens) -> generated ids; greedy, every prompt batched together
Generate = Callable[[list[list[int]], int], Any]

_seeds = itertools.count()


def fresh_prompts(batch: int, prompt_len: int, vocab_size: int = 49152) -> list[list[int]]:
    rng = np.random.default_rng(next(_seeds))
    return rng.integers(FIRST_PLAIN_TOKEN, vocab_size, size=(batch, prompt_len)).tolist()


def measure(runs: dict[str, Run], batch: int, prompt_len: int, new_tokens: int,
            repeats: int = 3) -> dict[str, Speed | Exception]:
    """Each system's median speed over `repeats` interleaved rounds; a system whose run raises gets
    its exception instead and leaves the rotation."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    failed: dict[str, Exception] = {}
    for round_ in range(repeats + 1):     # round 0 warms up: lazy init, allocator growth, kernels
        for name, run in runs.items():
            if name in failed:
                continue
            torch.set_num_threads(THREADS)   # a system may have changed it; every run starts equal
            try:
                t = run(batch, prompt_len, new_tokens)
            except Exception as e:
                failed[name] = e
                continue
            if round_:
                times[name].append(t)
    def speed(ts: list[tuple[float, float]]) -> Speed:
        prefill_s, decode_s = zip(*ts)
        decode = batch * (new_tokens - 1) / statistics.median(decode_s) if new_tokens > 1 else math.nan
        return Speed(decode=decode, prefill=batch * prompt_len / statistics.median(prefill_s))
    return {name: failed[name] if name in failed else speed(times[name]) for name in runs}


def by_subtraction(generate: Generate) -> Run:
    """For systems whose decode loop we cannot reach: prefill = generate(1 token); decode = the extra
    time of generate(N tokens). The two calls use different prompts (see the module docstring)."""
    def run(batch: int, prompt_len: int, new_tokens: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        generate(fresh_prompts(batch, prompt_len), 1)
        t1 = time.perf_counter()
        if new_tokens == 1:
            return t1 - t0, 0.0
        generate(fresh_prompts(batch, prompt_len), new_tokens)
        t2 = time.perf_counter()
        return t1 - t0, max((t2 - t1) - (t1 - t0), 1e-9)
    return run


# ---------------------------------------------------------------------------------------- transformers

@functools.cache
def hf_model(gguf_path: str, dtype: str) -> torch.nn.Module:
    """transformers dequantizes the GGUF itself (and undoes llama.cpp's Q/K permutation): same weights."""
    if dtype != "float32":  # one ~15 s GGUF load; other dtypes are a cast of it
        return copy.deepcopy(hf_model(gguf_path, "float32")).to(DTYPES[dtype])
    from transformers import AutoModelForCausalLM
    path = Path(gguf_path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    ids = torch.tensor(prompts)
    # eos_token_id=None: run past EOS like the engine's ignore_eos. min_new_tokens would instead forbid
    # EOS (its logit set to -inf) and so pick other tokens than the other systems.
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, eos_token_id=None,
                         pad_token_id=model.generation_config.pad_token_id)
    return out[:, ids.shape[1]:]


def transformers_run(gguf_path: str | os.PathLike[str], dtype: str) -> Run:
    return by_subtraction(functools.partial(hf_generate, hf_model(str(gguf_path), dtype)))

# ---------------------------------------------------------------------------------- plain torch loop

@dataclass
class Llama:
    embed: torch.Tensor                 # [vocab, dim], tied with the output head
    layers: list[dict[str, torch.Tensor]]
    norm: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    inv_freq: torch.Tensor              # [head_dim / 2] fp32


@functools.cache
def torch_llama(gguf_path: str, dtype: str) -> Llama:
    hf = hf_model(gguf_path, "float32")  # borrow transformers' GGUF loader; cast below
    cfg, sd = hf.config, {k: v.to(DTYPES[dtype]) for k, v in hf.state_dict().items()}
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    names = {"attn_norm": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    layers = [{ours: sd[f"model.layers.{i}.{theirs}.weight"] for ours, theirs in names.items()}
              for i in range(cfg.num_hidden_layers)]
    return Llama(embed=sd["model.embed_tokens.weight"], layers=layers, norm=sd["model.norm.weight"],
                 n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                 eps=cfg.rms_norm_eps,
                 inv_freq=1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # normalise in fp32 like transformers, so bf16 runs round the same way
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2  # transformers' (non-interleaved) rotate_half convention
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def forward(m: Llama, tokens: torch.Tensor, pos: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """tokens [B, T] at positions pos..pos+T; caches [layers, B, max_len, kv_heads, head_dim].
    Returns the last position's logits [B, vocab]. A multi-token call must start at pos 0 (prefill)."""
    B, T = tokens.shape
    x = m.embed[tokens]
    freqs = torch.outer(torch.arange(pos, pos + T, dtype=torch.float32), m.inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim], broadcast over heads
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    for i, w in enumerate(m.layers):
        h = rms_norm(x, w["attn_norm"], m.eps)
        q = rope(F.linear(h, w["wq"]).view(B, T, m.n_heads, m.head_dim), cos, sin)
        k_cache[i, :, pos:pos + T] = rope(F.linear(h, w["wk"]).view(B, T, m.n_kv_heads, m.head_dim), cos, sin)
        v_cache[i, :, pos:pos + T] = F.linear(h, w["wv"]).view(B, T, m.n_kv_heads, m.head_dim)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_cache[i, :, :pos + T].transpose(1, 2), v_cache[i, :, :pos + T].transpose(1, 2),
            is_causal=T > 1, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, T, -1), w["wo"])
        h = rms_norm(x, w["ffn_norm"], m.eps)
        x = x + F.linear(F.silu(F.linear(h, w["w_gate"])) * F.linear(h, w["w_up"]), w["w_down"])
    return F.linear(rms_norm(x[:, -1], m.norm, m.eps), m.embed)


@torch.inference_mode()
def torch_generate(m: Llama, prompts: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, float, float]:
    """Greedy; equal-length prompts. Returns (new ids [B, new_tokens], prefill s, decode s)."""
    tokens = torch.tensor(prompts)
    B, T = tokens.shape
    shape = (len(m.layers), B, T + new_tokens, m.n_kv_heads, m.head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=m.embed.dtype), torch.zeros(shape, dtype=m.embed.dtype)
    out = torch.empty(B, new_tokens, dtype=torch.long)
    t0 = time.perf_counter()
    out[:, 0] = forward(m, tokens, 0, k_cache, v_cache).argmax(-1)
    t1 = time.perf_counter()
    for i in range(1, new_tokens):
        out[:, i] = forward(m, out[:, i - 1:i], T + i - 1, k_cache, v_cache).argmax(-1)
    return out, t1 - t0, time.perf_counter() - t1


def torch_run(gguf_path: str | os.PathLike[str], dtype: str) -> Run:
    m = torch_llama(str(gguf_path), dtype)
    return lambda b, length, n: torch_generate(m, fresh_prompts(b, length), n)[1:]


def check_torch_loop(gguf_path: str | os.PathLike[str], new_tokens: int = 32) -> None:
    """The torch loop must pick exactly transformers' greedy tokens (fp32, one prompt)."""
    ours = torch_generate(torch_llama(str(gguf_path), "float32"), [CHECK_PROMPT], new_tokens)[0]
    theirs = hf_generate(hf_model(str(gguf_path), "float32"), [CHECK_PROMPT], new_tokens)
    assert torch.equal(ours, theirs), f"torch loop {ours.tolist()} != transformers {theirs.tolist()}"


# ------------------------------------------------------------------------------------------ llama.cpp

@functools.cache
def llama_cpp_model(gguf_path: str, n_threads: int) -> Any:
    from llama_cpp import Llama as LlamaCpp
    return LlamaCpp(model_path=gguf_path, n_ctx=2048, n_batch=512, n_threads=n_threads,
                    n_threads_batch=n_threads, verbose=False)


def llama_cpp_generate(llm: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """Greedy, one stream. Returns (new ids, prefill s, decode s). Argmax is taken over the last row
    of logits straight from the context, because 0.3.36 keeps `llm.scores` empty without logits_all."""
    import llama_cpp
    ctx, vocab = llm.ctx, llm.n_vocab()

    def argmax_last() -> int:
        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(vocab,)).argmax())

    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    out = [argmax_last()]
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        llm.eval(out[-1:])
        out.append(argmax_last())
    return out, t1 - t0, time.perf_counter() - t1


def llama_cpp_run(gguf_path: str | os.PathLike[str], n_threads: int = 2) -> Run:
    """One stream only: the batch must be 1."""
    llm = llama_cpp_model(str(gguf_path), n_threads)
    def run(b: int, length: int, n: int) -> tuple[float, float]:
        assert b == 1, "llama.cpp runs one stream"
        return llama_cpp_generate(llm, fresh_prompts(1, length)[0], n)[1:]
    return run

if __name__ == "__main__":
    from gguf_variants import default_gguf
    check_torch_loop(default_gguf())
    print("torch loop matches transformers' greedy tokens")
