"""agentenv: an agent-environment gym and a FlashREINFORCE training harness for language-model agents."""

__version__ = "0.1.0"

from agentenv import envs as _envs  # noqa: E402,F401  (registers the agentenv/ gymnasium envs)
