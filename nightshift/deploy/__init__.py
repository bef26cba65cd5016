"""Deployment targets: `local` (an MLflow model server on 127.0.0.1) and `kserve` (an InferenceService)."""

from __future__ import annotations
