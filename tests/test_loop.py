"""The async single-rollout loop and the sync GRPO baseline on CPU: real tiny model, real GuessNumber env, real learner.

Each test checks the accounting identity (every started trajectory in exactly one bucket) and that no thread the
loop started outlives it.
"""

import copy
import json
import os
import signal
import threading
import time

import gymnasium as gym
import pytest
from agentenv.core.config import LoopConfig
from agentenv.trainer.backends import GymEnvFactory
from agentenv.trainer.dispatch import PromptSampler
from agentenv.trainer.loop import Trainer
from signal_env import CoinEnvFactory, ShortTurnTinyFactory

from agentenv.core.policy import SamplingParams
from agentenv.core.runtime import EpisodeSpec, RolloutConfig

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny():
    """The tiny model and tokenizer, loaded once (from_pretrained costs seconds); tests deep-copy the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.samplers.models import resolve_model

    path = resolve_model("tiny").path
    return (AutoModelForCausalLM.from_pretrained(path, local_files_only=True),
            AutoTokenizer.from_pretrained(path, local_files_only=True), path)


def TinyPolicyFactory(tiny):
    """A fresh HFPolicy over a copy of the shared tiny weights whose turns end early (see tests/signal_env.py)."""
    return ShortTurnTinyFactory(tiny)


class LongTurnTinyFactory:
    """The plain tiny HFPolicy: its turns run to max_new_tokens, so episodes stay in flight (fault tests)."""

    def __init__(self, tiny):
        self.tiny = tiny

    def __call__(self, worker_index=0):
        from agentenv.samplers.hf_policy import HFPolicy

        model, tok, path = self.tiny
        return HFPolicy(copy.deepcopy(model), tok, name="tiny", model_path=path, seed=worker_index, device="cpu")


def make_learner(tiny, **kw):
    from agentenv.trainer.learner import Learner, LearnerConfig

    return Learner(copy.deepcopy(tiny[0]), LearnerConfig(lr=1e-4, **kw))


ROLLOUT = RolloutConfig(max_turns=2, max_total_tokens=512, sampling=SamplingParams(max_new_tokens=8))


def cfg(**kw):
    base = dict(batch_size=4, queue_size=2, num_workers=2, concurrency=2, total_updates=3, poll_interval_s=0.01)
    base.update(kw)
    return LoopConfig(**base)


TASKS = [EpisodeSpec(seed=i) for i in range(12)]
ENV = CoinEnvFactory()  # GuessNumber whose reward varies, so the learner really steps
GUESS = GymEnvFactory("agentenv/GuessNumber-v0")


def loop_threads():
    # The sandbox spawner thread is process-wide by design, not the loop's (see agentenv.sandboxes.process).
    return [t.name for t in threading.enumerate()
            if t.name.startswith("agentenv") and not t.name.startswith("agentenv-sandbox-spawner")]


def books_balance(s):
    buckets = s["trained"] + s["rejected"] + s["dropped"] + s["interrupted"] + s["in_flight"] + s["queued"] + s["learning"]
    assert s["started"] == buckets, s
    assert s["dropped"] == sum(s[f"dropped_{r}"] for r in ("stale", "worker_crash", "env_timeout", "error"))


class RecordingTrainer(Trainer):
    """Records the prompt index of every episode it starts, in order (what resume must reproduce)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.issued: list[int] = []

    def _start(self, prompt, group_id):
        started = super()._start(prompt, group_id)
        if started:
            self.issued.append(prompt)
        return started


def run(c, tiny, learner, tasks=TASKS, env=ENV, on_update=None, **kw):
    tr = RecordingTrainer(c, rollout=ROLLOUT, make_env=env, make_policy=TinyPolicyFactory(tiny), learner=learner, tasks=tasks,
                 on_update=on_update, **kw)
    summary = tr.run()
    return tr, summary


# ---------------------------------------------------------------------------------------------------------------------
def test_prompt_sampler_without_replacement_and_resumable():
    s = PromptSampler(5, seed=3)
    seq = [s.next() for _ in range(10)]
    assert sorted(seq[:5]) == list(range(5)) and sorted(seq[5:]) == list(range(5))
    assert seq[:5] != seq[5:]  # a new order each epoch (seeded)
    a = PromptSampler(5, seed=3)
    [a.next() for _ in range(7)]
    b = PromptSampler(5, seed=3)
    b.load_state_dict(a.state_dict())
    assert [a.next() for _ in range(6)] == [b.next() for _ in range(6)] == seq[7:10] + [PromptSampler(5, 3)._perm(2)[i] for i in range(3)]
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(5, seed=4).load_state_dict(a.state_dict())


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="mode"):
        LoopConfig(mode="ppo")
    with pytest.raises(ValueError, match="multiple of group_size"):
        LoopConfig(mode="sync_grpo", batch_size=6, group_size=4)
    with pytest.raises(ValueError, match="run_dir"):
        Trainer(LoopConfig(), rollout=ROLLOUT, make_env=ENV, make_policy=lambda i: None, learner=None, tasks=TASKS,
                resume=True)


def test_async_runs_updates_measures_lag_and_writes_logs(tiny, tmp_path):
    learner = make_learner(tiny)
    seen = []
    _, s = run(cfg(queue_size=2, total_updates=4), tiny, learner, on_update=seen.append, run_dir=tmp_path)
    assert s["updates"] == 4 and learner.step == 4
    # the version names the weights: it moves on real optimizer steps only (a zero-signal batch is skipped)
    assert learner.policy_version == 4 - sum(m["optimizer_step_skipped"] for m in seen) >= 1
    assert [m["update"] for m in seen] == [1, 2, 3, 4]
    for m in seen:
        assert m["accounting_balance"] == 0
        assert m["lag_max"] >= m["lag_mean"] >= 0
        for k in ("reward_mean", "success_rate", "tool_calls_mean", "acceptance_rate", "traj_per_s",
                  "learner_busy", "time_generation_s", "time_env_s", "time_learner_s", "loss"):
            assert k in m
    # Q=2 lets the next batch be generated while the learner updates: real (measured) lag appears
    assert max(m["lag_max"] for m in seen) > 0
    assert seen[0]["lag_max"] == 0  # the first batch can only come from version 0
    assert [m["policy_version"] for m in seen] == [
        sum(1 - x["optimizer_step_skipped"] for x in seen[:i + 1]) for i in range(4)]
    books_balance(s)
    assert s["trained"] + s["rejected"] == 16 and s["leftover_threads"] == 0
    assert loop_threads() == []
    # logs: one metrics line per update (+ shutdown), every consumed trajectory with its versions and status
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("update") for x in lines[:4]] == [1, 2, 3, 4] and lines[-1]["event"] == "shutdown"
    from agentenv.core.trajectory import read_jsonl

    trajs = read_jsonl(tmp_path / "trajectories.jsonl")
    used = [t for t in trajs if t.meta["loop"]["status"] in ("trained", "rejected")]
    assert len(used) == 16
    for t in used:
        lag = t.meta["loop"]["version"] - min(t.versions)
        assert lag == t.meta["loop"]["lag_max"] and lag >= 0
        assert all(v >= 0 for v, m in zip(t.policy_version, t.action_mask) if m)
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_keep_checkpoints_prunes_the_oldest_and_resume_uses_the_newest(tiny, tmp_path):
    from agentenv.trainer import loop_state

    learner = make_learner(tiny)
    run(cfg(total_updates=5, checkpoint_every=1, keep_checkpoints=2), tiny, learner, run_dir=tmp_path)
    ckpts = tmp_path / "checkpoints"
    # a checkpoint per update and one at shutdown (the same step 5, rewritten): the newest two remain, each a
    # directory with the learner's DCP files and the loop part; no temporary is left
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000004", "step_000005"]
    assert {p.name for p in (ckpts / "step_000005" / "learner").iterdir()} == {".metadata", "__0_0.distcp",
                                                                               "state.pt"}
    resumed = make_learner(tiny)
    path, state = loop_state.restore(tmp_path, resumed)
    assert path.name == "step_000005" and state["step"] == 5
    assert resumed.step == learner.step == 5 and resumed.policy_version == learner.policy_version
    for (k, v), (_, w) in zip(learner.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(v, w), k
    # the newest is never pruned, whatever keep says
    assert loop_state.prune(tmp_path, 1) == [ckpts / "step_000004"] and loop_state.latest(tmp_path) == path
    # a crash between the two renames of a same-step rewrite: the directory moved aside is put back
    os.replace(path, ckpts / ".step_000005.old.tmp")
    assert loop_state.latest(tmp_path) is None
    loop_state.remove_stale_tmp(tmp_path)
    assert loop_state.latest(tmp_path) == path and not list(ckpts.glob(".*"))


class SlowReset(gym.Wrapper):
    """reset() takes 0.5 s, so an episode spends its life in flight rather than in the completion queue: an episode
    that finished just before the kill (its result already sent, not yet polled) would be counted in flight by the
    test yet delivered, not lost."""

    def reset(self, *, seed=None, options=None):
        time.sleep(0.5)
        return self.env.reset(seed=seed, options=options)


def test_killed_worker_loses_only_its_in_flight_episodes(tiny):
    learner = make_learner(tiny)
    lost = {}
    holder = {}

    def on_update(m):
        # Kill at the first update that finds worker 0 mid-episode. Not always update 1: on a loaded machine the
        # learner can be slow enough that every started episode has finished and the queue is full (in flight: 0).
        tr = holder["tr"]
        n = tr.inflight_on(0)
        if "n" not in lost and m["update"] < 5 and n:
            lost["n"] = n
            tr.kill_worker(0)

    tr = Trainer(cfg(total_updates=6, queue_size=2), rollout=ROLLOUT, make_env=lambda: SlowReset(GUESS()),
                 make_policy=LongTurnTinyFactory(tiny), learner=learner,
                 tasks=TASKS, on_update=on_update)
    holder["tr"] = tr
    s = tr.run()
    assert "n" in lost, "worker 0 never had an episode in flight at an update: nothing was killed"
    assert s["updates"] == 6  # training went on
    assert s["worker_restarts"] == 1
    assert s["dropped_worker_crash"] == lost["n"] >= 1
    books_balance(s)
    assert loop_threads() == []


class WorkerCrash(BaseException):
    """Not an ``Exception``: run_episode does not catch it, so it takes the worker down (a simulated crash)."""


class CrashOnSeed(gym.Wrapper):
    """reset() raises a BaseException that run_episode does not catch: the worker dies, as a crashed process would.
    (reset, not step: the tiny model rarely ends a turn, and an unfinished turn ends the episode before env.step.)"""

    def __init__(self, env, seeds):
        super().__init__(env)
        self.seeds = seeds

    def reset(self, *, seed=None, options=None):
        if seed in self.seeds:
            raise WorkerCrash(f"simulated segfault on seed {seed}")
        return self.env.reset(seed=seed, options=options)


class HangOnSeed(gym.Wrapper):
    """reset() hangs on the given seeds until the env is closed (or 60 s)."""

    def __init__(self, env, seeds):
        super().__init__(env)
        self.seeds, self.released = seeds, threading.Event()

    def reset(self, *, seed=None, options=None):
        if seed in self.seeds:
            self.released.wait(60)
        return self.env.reset(seed=seed, options=options)

    def close(self):
        self.released.set()
        return super().close()


def test_crashing_env_takes_down_one_worker_and_the_run_goes_on(tiny):
    learner = make_learner(tiny)
    tasks = [EpisodeSpec(seed=100)] * 2 + [EpisodeSpec(seed=i) for i in range(10)]
    _, s = run(cfg(total_updates=3), tiny, learner, tasks=tasks, env=lambda: CrashOnSeed(GUESS(), {100}))
    assert s["updates"] == 3
    assert s["worker_restarts"] >= 1 and s["dropped_worker_crash"] >= 2  # the two crashing episodes at least
    books_balance(s)
    assert loop_threads() == []


def test_hanging_env_is_timed_out_and_counted(tiny):
    learner = make_learner(tiny)
    tasks = [EpisodeSpec(seed=i) for i in range(12)]
    holder = {}

    def on_update(m):
        if m["dropped_env_timeout"] >= 1 and m["update"] >= 2:
            holder["tr"].request_stop()

    env = lambda: HangOnSeed(GUESS(), {1, 5})
    tr = Trainer(cfg(total_updates=30, episode_timeout_s=1.0), rollout=ROLLOUT, make_env=env,
                 make_policy=LongTurnTinyFactory(tiny), learner=learner,
                 tasks=tasks, on_update=on_update)
    holder["tr"] = tr
    t0 = time.monotonic()
    s = tr.run()
    assert s["dropped_env_timeout"] >= 1 and s["updates"] >= 2
    assert time.monotonic() - t0 < 60
    books_balance(s)
    assert s["leftover_threads"] == 0 and loop_threads() == []  # closing the env released the hung step


def test_max_staleness_drops_stale_trajectories(tiny):
    learner = make_learner(tiny)
    seen = []
    _, s = run(cfg(total_updates=3, queue_size=3, max_staleness=0), tiny, learner, on_update=seen.append)
    assert s["updates"] == 3
    assert all(m["lag_max"] == 0 for m in seen)  # nothing older than the learner's version was trained
    assert s["dropped_stale"] >= 1
    books_balance(s)


def test_sigint_stops_cleanly_and_resume_continues_step_and_data_order(tiny, tmp_path):
    c = cfg(total_updates=10)

    def on_update(m):
        if m["update"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does

    prev = signal.getsignal(signal.SIGINT)
    tr1, s1 = run(c, tiny, make_learner(tiny), on_update=on_update, run_dir=tmp_path)
    assert signal.getsignal(signal.SIGINT) is prev  # handler restored
    assert s1["updates"] == 2 and s1["leftover_threads"] == 0 and loop_threads() == []
    books_balance(s1)
    from agentenv.trainer import checkpoint as ckpt

    state = ckpt.load(tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text() / "loop.pt")
    requeue = state["sampler"]["requeue"]
    # Every unfinished episode's prompt is issued again on resume; a prompt that was drawn but found no free slot
    # (at most one: dispatch stops at the first refusal) is already waiting in the sampler's requeue too.
    drawn_unplaced = len(requeue) - s1["interrupted"]
    assert drawn_unplaced in (0, 1)
    fresh = PromptSampler(len(TASKS), c.seed)
    order = [fresh.next() for _ in range(200)]
    assert tr1.issued == order[:len(tr1.issued)]

    learner2 = make_learner(tiny)
    seen = []
    tr2 = RecordingTrainer(cfg(total_updates=4), rollout=ROLLOUT, run_dir=tmp_path, resume=True, make_env=ENV,
                  make_policy=TinyPolicyFactory(tiny), learner=learner2, tasks=TASKS, on_update=seen.append)
    assert tr2.step == 2 and learner2.step == 2 and learner2.policy_version == tr1.learner.policy_version
    s2 = tr2.run()
    assert [m["update"] for m in seen] == [3, 4] and learner2.step == 4
    k = len(requeue)
    assert tr2.issued[:k] == requeue
    # The drawn-but-unplaced prompt (if any) was the next fresh one in the order: it is in the requeue, not skipped.
    nxt = len(tr1.issued) + drawn_unplaced
    assert requeue[len(requeue) - drawn_unplaced:] == order[len(tr1.issued):nxt]
    assert tr2.issued[k:] == order[nxt:nxt + len(tr2.issued) - k]
    assert s2["started"] == s1["started"] + len(tr2.issued)  # the books carry over
    books_balance(s2)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines if "update" in x] == [1, 2, 3, 4]


def test_sync_grpo_waits_for_whole_groups(tiny, tmp_path):
    learner = make_learner(tiny, loss="grpo")
    seen = []
    _, s = run(cfg(mode="sync_grpo", batch_size=4, group_size=2, total_updates=2),
                tiny, learner, on_update=seen.append, run_dir=tmp_path)
    assert s["updates"] == 2 and learner.step == 2
    assert all(m["lag_max"] == 0 for m in seen)  # on-policy: nothing is generated while the learner runs
    books_balance(s)
    from agentenv.core.trajectory import read_jsonl

    used = [t for t in read_jsonl(tmp_path / "trajectories.jsonl") if t.meta["loop"]["status"] == "trained"]
    for u in (1, 2):
        groups = {}
        for t in used:
            if t.meta["loop"]["update"] == u:
                groups.setdefault(t.meta["group_id"], set()).add(t.task)
        assert len(groups) == 2
        assert all(len(tasks) == 1 for tasks in groups.values())  # siblings share one prompt
    assert sum(1 for t in used) == 8


def test_fixed_lag_samples_every_batch_exactly_k_versions_behind(tiny):
    """The benchmarks' lag harness: with loop.fixed_lag=2 the samplers hold the weights of two updates ago, so
    update u trains on tokens sampled by version max(0, u - 3) while the learner is at u - 1."""
    learner = make_learner(tiny)
    seen = []
    tr, s = run(cfg(mode="sync_grpo", batch_size=4, group_size=1, total_updates=5, fixed_lag=2), tiny, learner,
                on_update=seen.append)
    # lag counts versions, and a batch of equal rewards makes no step and so no new version: the lag each update
    # must see is min(2, the learner's version before it), 0 1 2 2 2 when every update steps
    before = [0] + [m["policy_version"] for m in seen[:-1]]
    want = [min(2, v) for v in before]
    assert [m["lag_max"] for m in seen] == want and [m["lag_mean"] for m in seen] == want
    assert want[-1] == 2, f"too few optimizer steps to build the lag: versions {before}"
    assert tr.local_policy().policy_version == seen[-1]["policy_version"] - 2  # two versions behind at the end
    books_balance(s)
    with pytest.raises(ValueError, match="sync_grpo"):
        LoopConfig(fixed_lag=2)
    from agentenv.core.config import load_config

    with pytest.raises(ValueError, match="eval.at_end"):  # a mid-run evaluation would hand the sampler new weights
        load_config("demo", [], ["loop.mode=sync_grpo", "loop.fixed_lag=2", "eval.every=5"])


class _CloseCountingEnv(gym.Wrapper):
    def __init__(self, env):
        super().__init__(env)
        self.closed = 0

    def close(self):
        self.closed += 1
        return super().close()


def test_cancel_racing_an_episode_finish_never_pools_a_closed_env():
    """Force the interleaving the old worker got wrong: the episode has finished (its trajectory is built) and
    cancel() arrives before the worker settles it. The env must be closed exactly once and never reused."""
    import queue as _queue

    from agentenv.core.policy import SamplingParams as SP
    from agentenv.core.runtime import RolloutConfig as RC
    from agentenv.trainer.workers import RolloutWorker

    class Scripted:  # a text policy: the race is in the worker, not the model
        name = "scripted"

        def act(self, messages, info):
            return "50"

    finished, go = threading.Event(), threading.Event()

    class RacyWorker(RolloutWorker):
        def _settle(self, ep, traj):
            finished.set()
            go.wait(10)  # cancel() runs here, after run_episode returned and before the settle
            super()._settle(ep, traj)

    envs = []

    def make_env():
        envs.append(_CloseCountingEnv(ENV()))
        return envs[-1]

    sink = _queue.Queue()
    w = RacyWorker(0, make_env, Scripted(), RC(max_turns=1, sampling=SP(max_new_tokens=4)), sink=sink)
    w.submit(0, EpisodeSpec(seed=1))
    assert finished.wait(30)
    w.cancel(0)
    go.set()
    deadline = time.monotonic() + 10
    while envs[0].closed == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # let the settle finish
    assert envs[0].closed == 1  # closed once, by cancel
    assert w._pool == [] and sink.empty()  # not reused, result discarded
    RacyWorker._settle = RolloutWorker._settle  # the next episode settles normally
    w.submit(1, EpisodeSpec(seed=2))
    ev = sink.get(timeout=30)
    assert ev[0] == "done" and len(envs) == 2 and envs[1].closed == 0  # a fresh env, not the closed one
    assert w.close() == 0
    assert envs[1].closed == 1


def test_an_episode_cancelled_while_sampling_never_steps_its_env_again(caplog):
    """Shutdown and timeouts cancel episodes that are mid-generation. The sampled reply must not be played into an env
    that cancel is closing (that used to end as a spurious env_error on a closed env): the env sees no step after
    cancel, is closed exactly once, and the result is discarded."""
    import logging
    import queue as _queue

    from agentenv.core.policy import SamplingParams as SP
    from agentenv.core.runtime import RolloutConfig as RC
    from agentenv.trainer.workers import RolloutWorker

    thinking, release = threading.Event(), threading.Event()

    class SlowScripted:
        name = "scripted"

        def act(self, messages, info):
            thinking.set()
            release.wait(10)  # cancel() arrives while the policy is producing its reply
            return "50"

    class StepCounting(_CloseCountingEnv):
        steps = 0

        def step(self, action):
            StepCounting.steps += 1
            return super().step(action)

    envs = []

    def make_env():
        envs.append(StepCounting(ENV()))
        return envs[-1]

    sink = _queue.Queue()
    w = RolloutWorker(0, make_env, SlowScripted(), RC(max_turns=3, sampling=SP(max_new_tokens=4)), sink=sink,
                      cancel_grace_s=5.0)
    w.submit(0, EpisodeSpec(seed=1))
    assert thinking.wait(30)
    with caplog.at_level(logging.INFO, logger="agentenv.core.runtime"):
        w.cancel(0)
        release.set()
        assert w.close() == 0  # joins the episode thread and the closer
    assert envs[0].closed == 1 and StepCounting.steps == 0
    assert sink.empty() and w._pool == []
    assert not [r for r in caplog.records if "env_error" in r.getMessage()]
    # A cancellation is the loop's decision, not a fault: one INFO line saying so, no "policy_error" warning.
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "agentenv.core.runtime"]
    assert [lvl for lvl, m in said if "cancelled by its caller" in m] == [logging.INFO], said
    assert not [m for lvl, m in said if lvl >= logging.WARNING], said
