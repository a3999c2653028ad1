"""Memory: the meters that measure a step (live tensors, allocator, peak RSS), the metrics
logged per step, the analytic memory model and the estimator that reads a configuration or
a training command.

May import :mod:`..sharding`, :mod:`..checkpoint` (sizes) and :mod:`..tasks` (the
estimator registers the plugin's architectures); nothing above.
"""
