"""Samplers: the policies that produce tokens (transformers, vLLM) and the tiny CPU models they load.

Builds on core and envs; the trainer and the application import samplers, never the other way round."""
