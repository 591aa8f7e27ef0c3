"""Metrics: the Prometheus exporter of the staging pipeline and the Redis-side state it reports.

:mod:`~sink.ops.metrics.collect` reads the Redis side (stream lengths, consumer groups) that ``stats`` prints;
:mod:`~sink.ops.metrics.exporter` keeps the counters and turns that state into gauges. Nothing is re-exported
here.
"""

__all__ = ()
