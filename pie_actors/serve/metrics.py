"""`/metrics`: the server's own counters and latency histograms, and the engine's figures from
`runtime.stats()`, in the Prometheus text format. While the engine's process restarts (pie serve
--local) its figures are absent and `pie_engine_up` is 0."""
from __future__ import annotations

import bisect
import threading
from collections import Counter
from typing import Any

__all__ = ["Metrics"]

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)       # the last one: above every bucket
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            total += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {total}"]


class Metrics:
    """Counted by the app as requests end; `render` adds the engine's figures of the moment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()       # (route, status) -> requests
        self.tokens: Counter[str] = Counter()                     # prompt / completion / cached
        self.ttft = Histogram("pie_time_to_first_token_seconds",
                              "From a streamed request's arrival to its first output.", TTFT_BUCKETS)
        self.tpot = Histogram("pie_time_per_output_token_seconds",
                              "A streamed reply's time per output token after its first.", TPOT_BUCKETS)
        self.duration = Histogram("pie_request_duration_seconds",
                                  "From an endpoint request's arrival to its end.", DURATION_BUCKETS)

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[route, status] += 1

    def generation(self, usage: dict[str, int], duration: float, ttft: float | None, tpot: float | None) -> None:
        with self._lock:
            for kind in ("prompt_tokens", "completion_tokens", "cached_tokens"):
                self.tokens[kind] += int(usage.get(kind) or 0)
            self.duration.observe(duration)
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def render(self, stats: dict[str, Any] | None, restarts: int = 0) -> str:
        """The metrics text; `stats`: the engine's (None: it does not serve now), `restarts`: the
        engine processes started after one died."""
        with self._lock:
            lines = ["# HELP pie_requests_total HTTP requests by route and status.",
                     "# TYPE pie_requests_total counter"]
            lines += [f'pie_requests_total{{route="{route}",status="{status}"}} {n}'
                      for (route, status), n in sorted(self.requests.items())]
            lines += ["# HELP pie_tokens_total Tokens of endpoint requests: prompt, completion, and "
                      "prompt tokens found in cached KV pages.", "# TYPE pie_tokens_total counter"]
            lines += [f'pie_tokens_total{{kind="{kind.removesuffix("_tokens")}"}} {self.tokens[kind]}'
                      for kind in ("prompt_tokens", "completion_tokens", "cached_tokens")]
            for histogram in (self.ttft, self.tpot, self.duration):
                lines += histogram.lines()
        lines += ["# HELP pie_engine_up Whether an engine serves (0: loading, or its process restarting).",
                  "# TYPE pie_engine_up gauge", f"pie_engine_up {int(stats is not None)}",
                  "# HELP pie_engine_restarts_total Engine processes started after one died (pie serve --local).",
                  "# TYPE pie_engine_restarts_total counter", f"pie_engine_restarts_total {restarts}"]
        if stats is not None:
            lines += ["# HELP pie_running_inferlets Inferlets running on the model's engine.",
                      "# TYPE pie_running_inferlets gauge", f"pie_running_inferlets {stats.get('processes', 0)}",
                      "# HELP pie_kv_pages KV-cache pages: total, free, referenced by working sets, cached.",
                      "# TYPE pie_kv_pages gauge"]
            lines += [f'pie_kv_pages{{state="{state}"}} {n}' for state, n in sorted(stats.get("kv", {}).items())]
            states = stats.get("states", {})
            if states.get("total"):                   # a hybrid model's recurrent layers
                lines += ["# HELP pie_recurrent_states Recurrent-state slots (hybrid models): total, free, held "
                          "by working sets, prefix snapshots.", "# TYPE pie_recurrent_states gauge"]
                lines += [f'pie_recurrent_states{{state="{state}"}} {states.get(state, 0)}'
                          for state in ("total", "free", "held", "snapshots")]
            lines += ["# HELP pie_engine_batches_total Executed engine batches by their number of lanes.",
                      "# TYPE pie_engine_batches_total counter"]
            lines += [f'pie_engine_batches_total{{lanes="{size}"}} {n}'
                      for size, n in sorted(stats.get("batch_sizes", {}).items())]
            compile = stats.get("compile", {})
            lines += ["# HELP pie_compiled_decode_buckets The engine's decode batch-size buckets: total, ready "
                      "(running compiled), failed (running eager); the others run eager until compiled.",
                      "# TYPE pie_compiled_decode_buckets gauge"]
            lines += [f'pie_compiled_decode_buckets{{state="{state}"}} {compile.get(state, 0)}'
                      for state in ("total", "ready", "failed")]
            lines += ["# HELP pie_compiling_decode_bucket The batch size of the decode bucket compiling now; 0: none.",
                      "# TYPE pie_compiling_decode_bucket gauge", f"pie_compiling_decode_bucket {compile.get('compiling', 0)}"]
        return "\n".join(lines) + "\n"
