"""Real hostile code against the bubblewrap backend: every attack must be contained (see sandboxes/attacks.py).

The same attacks against the no-isolation ``subprocess`` backend must *succeed* for the harmless ones: that proves
the attacks are real and the judge can fail.
"""

import os
import shutil
import time
import warnings

import pytest

from agentenv.sandboxes import make_sandbox
from agentenv.sandboxes.attacks import ATTACKS, LIMITS, Target, judge, leftovers

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap)")
BY_NAME = {a.name: a for a in ATTACKS}


@pytest.fixture(scope="module")
def target():
    t = Target(secret_dir="/root" if os.access("/root", os.W_OK) else None)
    yield t
    t.close()


@pytest.fixture(scope="module")
def bwrap():
    with make_sandbox("bubblewrap", limits=LIMITS) as sb:
        yield sb


@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_attack_is_contained(bwrap, target, attack):
    v = judge(bwrap, attack, target)
    assert v.contained, f"{attack.guarantee}: {v.problems}\nstdout: {v.result.stdout[:500]}"


@pytest.mark.parametrize("name", ["fork_bomb", "sleeping_children", "output_flood"])
def test_attack_inside_a_session_restarts_it_cleanly(bwrap, target, name):
    a = BY_NAME[name]
    with bwrap.session() as s:
        s.run("before = 1")
        r = s.run(target.code(a, LIMITS, "999.12345"), LIMITS)
        # A flood spends CPU as fast as wall time: the CPU limit (1 s) may stop it before the wall timeout (2 s).
        assert (r.timed_out or r.cpu_exceeded) and r.session_restarted and r.wall_time_s < LIMITS.timeout_s + 1.5
        assert r.stdout.startswith("RAN uid=")
        uid = int(r.stdout.split()[1].split("=")[1])
        end = time.monotonic() + 2
        while leftovers(uid, "999.12345") and time.monotonic() < end:
            time.sleep(0.05)
        assert not leftovers(uid, "999.12345")
        assert s.run("print(1 + 1)").stdout == "2\n"  # the fresh interpreter works


@pytest.mark.parametrize("name", ["host_files", "tcp_localhost", "proc_snoop", "usr_host_config", "forged_marker",
                                  "alarm_between_cells", "threads_between_cells"])
def test_the_same_attacks_escape_without_isolation(target, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unsafe = make_sandbox("subprocess", limits=LIMITS)
    with unsafe:
        v = judge(unsafe, BY_NAME[name], target)
    assert not v.contained and any("ESCAPED" in p for p in v.problems), v.problems
