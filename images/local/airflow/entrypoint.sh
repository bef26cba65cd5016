#!/usr/bin/env bash
# The official Airflow image's convention: `bash ...` and `python ...` run as given, anything else is
# `airflow ...` (no arguments: `airflow --help`).
set -euo pipefail
case "${1:-}" in
    bash | python | sh) exec "$@" ;;
    airflow) shift; exec airflow "$@" ;;
    *) exec airflow "$@" ;;
esac
