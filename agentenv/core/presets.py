"""Preset files: where presets are found, how they are read, and how variants and ``--set`` overrides are merged
into a preset's mapping before :func:`agentenv.core.config.validate` types it.

Contract:

* Presets are found by name in ``$AGENTENV_CONFIGS``, then the repository's ``configs/`` (next to the package), then
  ``./configs``; a path to a ``.yaml`` file works too. A preset must be a YAML mapping.
* :func:`deep_merge` merges nested mappings key by key (``env.kwargs`` too); a tagged section (``algo.loss``) whose
  ``type`` changes is replaced whole. :func:`parse_override` reads ``"a.b=value"`` (the value as YAML);
  :func:`apply_override` sets it, dropping a tagged section's old options when ``type`` changes.
* Bad input raises :class:`ConfigError` with one message naming the key or file.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A preset or override is invalid; the message names the dotted key and what is allowed."""


TAGGED_SECTIONS = {("algo", "loss")}  # sections that are a discriminated union (their `type` picks the member)


def config_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("AGENTENV_CONFIGS"):
        dirs.append(Path(os.environ["AGENTENV_CONFIGS"]))
    here = Path(__file__).resolve().parent  # agentenv/core
    dirs.append(here.parents[1] / "configs")  # the repo (editable install)
    dirs.append(here.parent / "configs")  # installed wheel: configs/ ships as agentenv.configs
    dirs.append(Path.cwd() / "configs")
    return dirs


def list_presets() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for d in reversed(config_dirs()):
        for p in sorted(d.glob("*.yaml")) if d.is_dir() else []:
            out[p.stem] = p
    return dict(sorted(out.items()))


def find_preset(name: str) -> Path:
    p = Path(name).expanduser()
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    key = name
    presets = list_presets()
    if key not in presets:
        raise ConfigError(f"no preset named {name!r}. Presets: {', '.join(presets) or '(none found)'}; searched "
                          f"{', '.join(str(d) for d in config_dirs())}. Or pass a path to a .yaml file.")
    return presets[key]


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a preset must be a YAML mapping, got {type(data).__name__}")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and v.get("type", out[k].get("type")) != out[k].get("type"):
            out[k] = copy.deepcopy(v)  # a tagged section (algo.loss) that changes its type starts afresh
        elif isinstance(v, dict) and isinstance(out.get(k), dict) and k != "kwargs":
            out[k] = deep_merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):  # env.kwargs merges too, key by key
            out[k] = {**out[k], **v}
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE with a dotted key (e.g. loop.batch_size=4), got {item!r}")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        nxt = node.setdefault(part, {})
        if isinstance(nxt, str) and tuple(path[: i + 1]) in TAGGED_SECTIONS:
            nxt = node[part] = {"type": nxt}  # `loss: grpo` is shorthand for `loss: {type: grpo}`
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is a value, not a section")
        node = nxt
    if path[-1] == "type" and node.get("type", value) != value:
        node.clear()  # a tagged section (algo.loss) that changes its type drops the old type's options
    node[path[-1]] = value


def preset_variants(preset: str) -> list[str]:
    return list((read_yaml(find_preset(preset)).get("variants") or {}).keys())
