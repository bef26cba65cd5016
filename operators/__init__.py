"""Airflow glue for Nightshift: the HorovodKubernetesOperator and its launcher, trigger and spec builder."""
