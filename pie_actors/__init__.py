"""pie_actors: a programmable LLM serving system. A request is a program (an inferlet) that drives
the generation loop itself; this package runs inferlets in WebAssembly sandboxes next to an engine
that batches the forward passes of every running program, in one process or on a Ray cluster.

    from pie_actors import Runtime
    with Runtime.local() as runtime:
        print(runtime.launch("main.py", {"question": "What is the capital of France?"}).result())
"""
from .config import Config, EngineConfig, RunLimits
from .process import Done, Event, Failed, File, InferletError, Process, Send
from .program import Program
from .runtime import Runtime

__all__ = ["Runtime", "Process", "Program", "Send", "File", "Done", "Failed", "Event", "InferletError",
           "Config", "EngineConfig", "RunLimits"]
