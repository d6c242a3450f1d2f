"""The inferlet runtime's host side: the WebAssembly sandbox (host.py), building and caching the
runner component (build.py), the WIT world (wit/) and the guest SDK sources (sdk/)."""
from .build import Artifact, build_bundle, ensure_runner, new_engine
from .host import FutureTable, HostApi, HostOpError, InferletError, Sandbox

__all__ = ["Sandbox", "HostApi", "HostOpError", "FutureTable", "InferletError",
           "Artifact", "build_bundle", "ensure_runner", "new_engine"]
