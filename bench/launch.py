"""Launch latency of an inferlet on a Ray cluster: a launch through `Runtime.connect` (into free
room of a running inferlet host actor) vs a new actor per launch, for a trivial inferlet (so the table shows
launch cost, not model work).

    python bench/launch.py [--launches 8] [--out bench/RESULTS.md]

Both measure client-side wall time from the launch to holding the inferlet's result: the warm
launch is `runtime.launch(...).result()`; the new-actor launch creates an InferletActor and reads
its run's events to the Done. The bench starts a Ray cluster of its own, so the engines and host
actors of a cluster already running here do not count. The dummy model's engine serves the one
`model.name()` call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
from report import add_output_options, publish

from pie_actors import Done, Program, Runtime
from pie_actors.controller import NAMESPACE, connect
from pie_actors.inferlet.actor import inferlet_actor
from pie_actors.launch import Launch

TRIVIAL = Program.load("from inferlet import model\n\nasync def main(input):\n    return {'model': model.name()}\n")
WARM, COLD = "into free room (Runtime.connect launch)", "new actor per launch"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=8)
    add_output_options(ap, "Inferlet launch: into a running host actor vs a new actor")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    ray.init(address="local", num_cpus=os.cpu_count(), namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        with Runtime.connect(model="dummy") as runtime:
            # the engine the runtime asked the Controller for (one per model: the same actor)
            _, address = ray.get(connect().engine.remote(runtime.config.engine))
            cls = inferlet_actor()

            def warm() -> None:
                assert "model" in runtime.launch(TRIVIAL).result()

            def cold() -> None:
                actor = cls.remote()
                launch = Launch(TRIVIAL, limits=runtime.config.limits, name="cold")
                events = [e for ref in actor.run.remote(launch, address) for e in ray.get(ref)]
                assert isinstance(events[-1], Done), events[-1]
                ray.kill(actor)

            times = {}
            for name, launch in ((WARM, warm), (COLD, cold)):
                launch()                                        # warm-up
                samples = []
                for _ in range(args.launches):
                    time.sleep(0.2)                 # the last run's end reaches the Controller
                    t0 = time.perf_counter()
                    launch()
                    samples.append(time.perf_counter() - t0)
                times[name] = statistics.median(samples)
    finally:
        ray.shutdown()
    report = "\n".join(["| launch | median ms | × warm |", "|---|---|---|"] +
                       [f"| {name} | {t * 1e3:.1f} | {t / times[WARM]:.1f} |" for name, t in times.items()]) + "\n"
    env = (f"Ray {ray.__version__}, {os.cpu_count()} cores; trivial inferlet, dummy model; median of "
           f"{args.launches}; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
