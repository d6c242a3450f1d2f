"""Shared helpers for engine tests: tiny random Hugging Face models and transformers references."""
from __future__ import annotations

from pathlib import Path

import torch

from pie_actors.gpu.engine import Engine
from pie_actors.inferlet.engine_client import EngineClient

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            tie_word_embeddings=False)


# Qwen3.5's hybrid: three gated DeltaNet layers, then a gated attention layer, twice
TINY_HYBRID = dict(TINY, num_hidden_layers=8, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=16, linear_value_head_dim=16)


def save_tiny_model(family: str, folder: Path, seed: int = 0, vocab_size: int | None = None,
                    **save_options) -> Path:
    """A randomly initialised Llama/Qwen2/Qwen3/Qwen3.5-shaped model written as a Hugging Face folder
    ("qwen3_5": Qwen3_5ForCausalLM; "qwen3_5_vl": the text part of Qwen3_5ForConditionalGeneration,
    with a one-block vision tower). `vocab_size` replaces the tiny 512 (a real tokenizer's ids);
    `save_options`: save_pretrained's, max_shard_size say."""
    import transformers
    torch.manual_seed(seed)
    tiny = TINY if vocab_size is None else dict(TINY, vocab_size=vocab_size)
    hybrid = TINY_HYBRID if vocab_size is None else dict(TINY_HYBRID, vocab_size=vocab_size)
    if family == "qwen3_5":
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hybrid))
    elif family == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
        model = transformers.Qwen3_5ForConditionalGeneration(
            transformers.Qwen3_5Config(text_config=hybrid, vision_config=vision))
    elif family == "qwen3":           # head_dim 64: a size the CPU attention kernel serves
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=64, **tiny))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**tiny))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**tiny))
    with torch.no_grad():   # default init leaves biases 0 and norms 1: randomise so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "lm_head" in name and family.startswith("qwen3_5"):
                p.normal_(0, 0.5)   # logits far apart: float32 rounding never flips a greedy token
    model.save_pretrained(folder, **save_options)
    return folder



def save_tiny_hybrid(folder: Path, tokenizer_dir: Path) -> Path:
    """A random Qwen3.5 folder that speaks the tokenizer in `tokenizer_dir` (the default model's),
    so that chat templates and text prompts work on it."""
    from pie_actors.tokenizer import Tokenizer
    save_tiny_model("qwen3_5", folder, vocab_size=Tokenizer.from_dir(tokenizer_dir).vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return folder

def saved_state(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder as transformers loads them: a loader's reference."""
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(folder).state_dict()


def make_engine(model_dir: Path, *, num_pages: int = 256, dtype: str = "float32", **settings) -> Engine:
    """An eager engine on the CPU; `settings` are further engine settings by name (page_size, hugepages...)."""
    settings.setdefault("compile", "off")
    return Engine.from_model(str(model_dir), device="cpu", dtype=dtype, num_pages=num_pages, **settings)


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and the logits of every step (a plain loop: `generate` would
    apply logits processors, e.g. min_new_tokens masks EOS)."""
    tokens, logits, past, feed = [], [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            out = model(feed, past_key_values=past, use_cache=True)
            past, row = out.past_key_values, out.logits[0, -1]
            logits.append(row)
            tokens.append(int(row.argmax()))
            feed = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(logits)


def serve(model_dir: Path):
    """The model's engine (float32) started and served on a local port: yields (engine, server)."""
    from pie_actors.gpu.engine.data_plane import EngineServer
    engine = make_engine(model_dir, num_pages=256).start()
    server = EngineServer(engine)
    server.start()
    try:
        yield engine, server
    finally:
        server.close()
        engine.close()


async def decode(client: EngineClient, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding of n tokens through the client, on a fresh sequence it frees afterwards."""
    seq = await client.create()
    out, feed = [], prompt
    for _ in range(n):
        [token] = await client.forward([{"seq": seq, "tokens": feed}])
        out.append(token)
        feed = [token]
    await client.free(seq)
    return out
