"""The rank runtime every program stands on: preemption, the watchdog, stopping, attempts, the checkpoint
transaction, random state, user entry points, the monitor, health checks and exporters."""
