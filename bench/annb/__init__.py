"""ann-benchmarks algorithm module for tqvec (``module.py`` + ``config.yml`` + ``Dockerfile``), and the
competitor wrappers the self-contained runner :mod:`bench.sweep` uses in the same ``BaseANN`` style."""
