"""Preset YAML files (``agentenv run --env NAME`` loads ``NAME.yaml``); installed as package data ``agentenv.configs``."""
