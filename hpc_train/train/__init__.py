"""Compute-node training code: data, model, engine and loop. Only ``prepare`` is meant for login nodes."""
