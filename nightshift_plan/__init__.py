"""`nightshift plan`: what a `nightly_retrain` run would submit, rendered without a cluster.

The top layer: it loads the DAG file (dags/) and builds the MPIJob with the operator's code (operators/), so it
sits above both, beside scripts/ and bench/. The `nightshift` CLI finds its subcommand through the
`nightshift.commands` entry-point group (pyproject.toml), never by importing this package by name.
"""
