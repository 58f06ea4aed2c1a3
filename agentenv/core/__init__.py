"""The runtime core: trajectories, chat sequences, one episode's loop, the policy protocol, config and metrics.

Imports nothing from the rest of agentenv (envs, samplers, trainer and run all build on it)."""
