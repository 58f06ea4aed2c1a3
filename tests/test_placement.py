"""Placement groups for learner ranks and engines (agentenv.trainer.placement) on a local Ray cluster that declares
logical GPUs: disjoint GPU ids as Ray assigns them, and a cluster too small refused with the arithmetic."""

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed")
pytestmark = pytest.mark.ray


def test_learner_ranks_and_engines_get_disjoint_gpus_and_a_small_cluster_is_refused(monkeypatch):
    from agentenv.trainer.placement import Placement, PlacementError, where

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    p = Placement(learner_ranks=2, engines=2, gpus=True, engine_gpus=1, engine_cpus=0.5, ray_cpus=3, ray_gpus=4)
    try:
        remote = ray.remote(where)
        got = ray.get([remote.options(**p.learner_options(r)).remote() for r in range(2)]
                      + [remote.options(**p.engine_options(i)).remote() for i in range(2)], timeout=600)
    finally:
        p.close()
    assert not ray.is_initialized()  # it started Ray, so it shut it down
    gpus = [g for w in got for g in w["gpus"]]
    assert all(len(w["gpus"]) == 1 for w in got) and sorted(gpus) == ["0", "1", "2", "3"], got

    with pytest.raises(PlacementError, match=r"2 learner ranks x \(1 GPU, 1 CPU\) \+ 2 engines x \(1 GPU, 0.5 CPU\) "
                                             r"= 4 GPUs, 3 CPUs"):
        Placement(learner_ranks=2, engines=2, gpus=True, engine_gpus=1, engine_cpus=0.5, ray_cpus=3, ray_gpus=3)
    assert not ray.is_initialized()
