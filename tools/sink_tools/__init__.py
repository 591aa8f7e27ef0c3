"""Tools of this repository, not of the library: benchmarks, the simulated engine, the demo, the HTML report and
the local-cluster launcher. The library packages (``sink``, ``worker``) never import them; the command line
(``sink_cli``) does."""

__all__ = ()
