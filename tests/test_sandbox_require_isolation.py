"""``require_isolation``: with it, a sandbox (``make_sandbox``, ``PythonToolEnv``, a preset's env kwargs,
``agentenv sandbox run --require-isolation``) refuses to start unless namespaces, seccomp and cgroups are all
active, with one line naming what is missing; the paper preset sets it."""

import os
import shutil
import subprocess
import sys
import warnings

import pytest
import yaml

from agentenv.sandboxes import cgroups, isolation_gaps, make_sandbox, seccomp_filter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap)")


def _need_all_layers():
    if seccomp_filter.bpf() is None or cgroups.manager() is None:
        pytest.skip(f"not every layer is available here: {isolation_gaps('bubblewrap')}")


def test_with_every_layer_it_runs_and_uses_them():
    _need_all_layers()
    with make_sandbox("bubblewrap", require_isolation=True) as sb:
        assert sb.seccomp is not None and sb.cgroups is not None
        assert sb.run("print(6 * 7)").stdout == "42\n"


@pytest.mark.parametrize("backend, kwargs, missing", [("bubblewrap", {"seccomp": False}, "seccomp (turned off)"),
                                                      ("bubblewrap", {"cgroups": False}, "cgroups (turned off)"),
                                                      ("subprocess", {}, "namespaces; seccomp; cgroups")])
def test_a_missing_layer_is_refused_in_one_line(backend, kwargs, missing):
    with pytest.raises(RuntimeError) as e, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_sandbox(backend, require_isolation=True, **kwargs)
    assert missing in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"require_isolation: refusing to start the {backend} sandbox without ")


def test_the_cli_refuses_when_cgroups_cannot_be_delegated(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to make the cgroup filesystem read-only in a private mount namespace")
    (tmp_path / "a.py").write_text("print(1)\n")
    script = ("for m in $(awk '$3 ~ /^cgroup/ {print $2}' /proc/self/mounts); do mount -o remount,bind,ro $m; done; "
              f"exec {sys.executable} -m agentenv.cli sandbox run --require-isolation {tmp_path / 'a.py'}")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("agentenv sandbox:")]
    assert line and "require_isolation: refusing to start the bubblewrap sandbox without cgroups" in line[0], p.stderr


def test_python_tool_env_and_the_paper_preset():
    _need_all_layers()
    from agentenv.envs.python_tool import PythonToolEnv

    with open(os.path.join(ROOT, "configs", "python_tool.yaml")) as f:
        kwargs = yaml.safe_load(f)["env"]["kwargs"]
    assert kwargs["require_isolation"] is True
    env = PythonToolEnv(num_tasks=2, backend=kwargs["backend"], require_isolation=kwargs["require_isolation"])
    try:
        assert env.sandbox.seccomp is not None and env.sandbox.cgroups is not None
    finally:
        env.close()
    with pytest.raises(RuntimeError, match="require_isolation"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PythonToolEnv(num_tasks=2, backend="subprocess", require_isolation=True)
    checks = PythonToolEnv.preflight(backend="subprocess", require_isolation=True)
    assert [c.ok for c in checks if c.what == "sandbox isolation"] == [False]
