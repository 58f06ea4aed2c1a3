"""The application: the launch plan, episode sets, evaluation, the training run, SFT, reports, the demo, plots.

Wires core, envs, samplers and trainer together; only the CLI imports it."""
