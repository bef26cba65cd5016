"""Training backends, one module each (issue 25). H4 stub: H2's registry replaces this file when merged."""
