"""Task bodies and small operator adapters of the `nightly_retrain` DAG.

The DAG file only wires; the work lives here. Every heavy import (torch, GX, DVC, MLflow, the
`nightshift` library) happens inside a task, so importing this package stays cheap at parse time.
"""
