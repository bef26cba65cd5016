"""The Horovod + PyTorch trainer: `python -m nightshift.train` under horovodrun or an MPIJob launcher.

Importing this package is cheap; torch and horovod are imported by the modules that need them.
"""
