"""The same async loop with rollout workers as real Ray actors on a local ``ray.init(num_cpus=2)`` cluster.

One test (actor start-up dominates its cost): it trains several updates, kills one actor process mid-run
(``ray.kill``), and checks that training goes on, the actor's in-flight episodes are counted as ``worker_crash``,
the books balance, and nothing is left behind (actors, threads, the cluster this run started).
"""

import copy
from pathlib import Path
import os
import threading

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'agentenv[ray]')")

from agentenv.core.config import LaunchConfig, LoopConfig
from agentenv.samplers.factory import HFPolicyFactory
from agentenv.trainer.backends import GymEnvFactory
from agentenv.trainer.loop import Trainer

from agentenv.core.policy import SamplingParams
from agentenv.core.runtime import EpisodeSpec, RolloutConfig

pytestmark = pytest.mark.ray


def test_ray_backend_trains_survives_actor_kill_and_cleans_up():
    from agentenv.trainer.learner import Learner, LearnerConfig
    from transformers import AutoModelForCausalLM

    from agentenv.samplers.models import resolve_model

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    assert not ray.is_initialized()
    learner = Learner(AutoModelForCausalLM.from_pretrained(resolve_model("tiny").path, local_files_only=True),
                      LearnerConfig(lr=1e-4))
    cfg = LoopConfig(backend="ray", batch_size=4, queue_size=2, num_workers=2, concurrency=2, total_updates=4)
    launch = LaunchConfig(ray_num_cpus=2, worker_num_cpus=0.5)
    rollout = RolloutConfig(max_turns=2, max_total_tokens=512, sampling=SamplingParams(max_new_tokens=8))
    seen, lost, holder = [], {}, {}

    def on_update(m):
        seen.append(copy.deepcopy(m))
        if m["update"] == 2:
            tr = holder["tr"]
            lost["n"] = tr.inflight_on(1)
            tr.kill_worker(1)  # ray.kill of the actor process

    # picklable factories: the actors import them by reference
    # picklable factories whose episodes have reward variance, so the learner really steps (tests/signal_env.py);
    # the actors get them by value (the tests folder is not importable in their processes)
    import signal_env
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(signal_env)
    tr = Trainer(cfg, rollout=rollout, launch=launch, make_env=signal_env.CoinEnvFactory(),
                 make_policy=signal_env.ShortTurnTinyFactory(),
                 learner=learner, tasks=[EpisodeSpec(seed=i) for i in range(12)], on_update=on_update)
    holder["tr"] = tr
    s = tr.run()
    assert s["updates"] == 4 and learner.step == 4 and learner.policy_version >= 1
    assert max(m["lag_max"] for m in seen) > 0  # measured, across actor processes
    assert s["worker_restarts"] == 1
    assert s["dropped_worker_crash"] == lost["n"]
    assert all(m["accounting_balance"] == 0 for m in seen)
    assert s["started"] == (s["trained"] + s["rejected"] + s["dropped"] + s["interrupted"])
    assert s["leftover_threads"] == 0
    assert not ray.is_initialized()  # the cluster this run started is shut down (actors with it)
    # The sandbox's spawner thread is process-wide by design (bubblewrap children die with the thread that spawned
    # them), so it is not the loop's to stop.
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("agentenv") and not t.name.startswith("agentenv-sandbox-spawner")] == []


def test_periodic_eval_uses_the_learners_current_weights_with_ray_rollouts(tmp_path, monkeypatch):
    """With rollout workers in Ray actors the driver has no sampler of its own: evaluation must still play the
    learner's CURRENT weights (the tokens of the eval trajectories carry the version that sampled them). The model
    and env have a learning signal (tests/signal_env.py), so every update is a real optimizer step."""
    import signal_env

    from agentenv.core.config import load_config
    from agentenv.run.train import run

    tests = str(Path(signal_env.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", tests + os.pathsep + os.environ.get("PYTHONPATH", ""))  # for the actors
    model = signal_env.two_token_model_dir(tmp_path / "model")
    cfg = load_config("text_env", [], [
        "env.id=signal_env:CoinGuess-v0", f"model.name={model}", "model.dtype=float32", "loop.backend=ray",
        "loop.num_workers=1", "loop.batch_size=4", "loop.total_updates=3", "eval.every=1", "eval.episodes=2",
        "eval.at_end=false", "rollout.max_new_tokens=8", "launch.ray_num_cpus=2", "launch.worker_num_cpus=0.5",
        "run.plot=false", f"run.dir={tmp_path / 'run'}", "algo.lr=1e-3"])
    res = run(cfg, progress=False, echo=lambda *a: None)
    versions = [m["policy_version"] for m in res.history]
    assert versions[-1] >= 1  # real steps happened
    assert [e["update"] for e in res.evals] == [1, 2, 3]
    assert [e["policy_versions"] for e in res.evals] == [[v] for v in versions]
    assert res.summary["components"]["rollout_backend"] == "ray" and res.summary["components"]["sampler"] == "hf"
    assert not ray.is_initialized()
