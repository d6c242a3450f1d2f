"""Launch latency of an inferlet on a Ray cluster: a warm actor from the Controller's pool vs a
new actor per launch, for a trivial inferlet (so the table shows launch cost, not model work).

    python bench/launch.py [--launches 8] [--out bench/RESULTS.md]

Both measure client-side wall time from asking for an actor to holding the inferlet's result.
The dummy model's engine serves the one `model.name()` call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import ray
from report import publish

from pie_actors.controller import connect
from pie_actors.inferlet.actor import inferlet_actor

TRIVIAL = "from inferlet import model\n\nasync def main(input):\n    return {'model': model.name()}\n"


def run(actor, address) -> dict:
    return [ray.get(ref) for ref in actor.run.remote(TRIVIAL, {}, address)][-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=8)
    ap.add_argument("--out", help="append the table, command line and date to this markdown file")
    ap.add_argument("--title", default="Inferlet launch: warm pool vs new actor")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        controller = connect(pool_size=2)
        address = ray.get(controller.engine.remote("dummy"))
        cls = inferlet_actor()

        def warm() -> None:
            actor = ray.get(controller.acquire.remote())
            assert "result" in run(actor, address)
            ray.get(controller.release.remote(actor))

        def cold() -> None:
            actor = cls.remote()
            assert "result" in run(actor, address)
            ray.kill(actor)

        times = {}
        for name, launch in (("warm pool (Controller.acquire)", warm), ("new actor per launch", cold)):
            launch()                                        # warm-up
            samples = []
            for _ in range(args.launches):
                t0 = time.perf_counter()
                launch()
                samples.append(time.perf_counter() - t0)
                time.sleep(0.2)                             # let the pool refill between launches
            times[name] = statistics.median(samples)
    finally:
        ray.shutdown()
    warm_t = times["warm pool (Controller.acquire)"]
    report = "\n".join(["| launch | median ms | × warm |", "|---|---|---|"] +
                       [f"| {name} | {t * 1e3:.1f} | {t / warm_t:.1f} |" for name, t in times.items()]) + "\n"
    env = (f"Ray {ray.__version__}, {os.cpu_count()} cores; trivial inferlet, dummy model; median of "
           f"{args.launches}; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    publish(env, report, args.out, args.title)


if __name__ == "__main__":
    main()
