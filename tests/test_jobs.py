"""Bundles as Ray jobs: a manifest (pie.toml) names a bundle's entry, `ray job submit --working-dir
DIR -- pie run main.py -- --key value` runs it (and a JavaScript bundle's main.js) on a running
cluster's engine and Controller, and ray_cluster.yaml passes Ray's own cluster-config validation."""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import yaml

from cluster_helpers import ray_head, run_job
from pie_actors.program import Manifest, ManifestError, Program

ROOT = Path(__file__).resolve().parent.parent
HELPER = "def greet(name):\n    return 'hello ' + name\n"
AGENT = """
from greeting import greet
from inferlet import model

async def main(input):
    return {"greeting": greet(input["name"]), "model": model.name()}
"""
MANIFEST = '[bundle]\nname = "greeter"\nversion = "0.2.0"\nentry = "agent.py"\n'


def _bundle(folder: Path, entry: str = "agent.py") -> Path:
    folder.mkdir()
    (folder / "greeting.py").write_text(HELPER)
    (folder / entry).write_text(AGENT)
    (folder / "pie.toml").write_text(MANIFEST.replace("agent.py", entry))
    return folder


def test_the_manifest_names_the_entry_and_any_file_beside_it_loads_the_bundle(tmp_path):
    folder = _bundle(tmp_path / "b")
    assert Manifest.read(folder) == Manifest("greeter", "0.2.0", "agent.py")
    for path in (folder, folder / "greeting.py"):
        program = Program.load(str(path))
        assert program.bundle == {"greeting.py": HELPER, "main.py": AGENT}     # the entry runs as main
    from pie_actors.inferlet.build import _scan_bundle
    files, preimport, _ = _scan_bundle(folder)                 # what `pie build` bakes in
    assert files["main"][2] == AGENT and "greeting" in preimport
    (folder / "pie.toml").write_text('[bundle]\nname = "greeter"\n')
    with pytest.raises(ManifestError, match="bundle.version must be a non-empty string"):
        Program.load(str(folder))
    (folder / "pie.toml").write_text(MANIFEST.replace("agent.py", "nowhere.py"))
    with pytest.raises(ManifestError, match="'nowhere.py' is not a .py file of the bundle"):
        Program.load(str(folder))
    (folder / "main.py").write_text(AGENT)
    (folder / "pie.toml").write_text(MANIFEST)
    with pytest.raises(ManifestError, match="has a main.py too"):
        Program.load(str(folder))


def test_ray_cluster_yaml_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    nodes = config["available_node_types"]
    workers = [name for name in nodes if name != config["head_node_type"]]
    assert workers and all("g5" in nodes[n]["node_config"]["InstanceType"] for n in workers)   # GPU types
    setup = " ".join(config["setup_commands"])
    assert "pip install -e ~/pie_actors" in setup and "pie model import smollm2-135m-instruct" in setup
    head = " ".join(config["head_start_ray_commands"])
    assert "pie serve --host 0.0.0.0 --port 8080" in head and "--dashboard-port=8265" in head
    broken = copy.deepcopy(config)
    broken["available_node_types"]["head"]["no_such_field"] = 1
    with pytest.raises(Exception, match="no_such_field"):
        validate_config(prepare_config(broken))


def test_ray_job_submit_runs_a_bundle_on_the_clusters_engine(default_model_dir, tmp_path, monkeypatch):
    """A Python bundle, then a JavaScript one, each a job on the same running cluster."""
    from tests.test_js_front_doors import _bundle as js_bundle
    bundle = _bundle(tmp_path / "greeter", entry="main.py")
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, PIE_HOME=str(default_model_dir.parent.parent),
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with ray_head(env, dashboard=True) as (env, dash):
        logs = run_job(dash, bundle, "pie run --dtype float32 --compile off main.py -- --name pie")
        assert '{"greeting": "hello pie", "model": "smollm2-135m-instruct"}' in logs
        logs = run_job(dash, js_bundle(tmp_path / "js-greeter"), "pie run --dtype float32 --compile off main.js "
                       "-- --name pie")
        assert '{"greeting": "hello pie", "model": "smollm2-135m-instruct"}' in logs
